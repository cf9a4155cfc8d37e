"""Static shards of a warm's plan, for fleets that outgrow a host: ``cache warm --shard I/N``.

A batch scheduler starts N tasks that each know their index and the count, and nothing else (a Kubernetes Indexed
Job, a Slurm job array, a CI matrix). Each task plans the whole warm and keeps its slice: the share groups of the
plan's looked-up jobs (``sharing``: jobs that one encode fills stay together) dealt largest encode first into N bins
by ``share_jobs``, the same rule torchrun's workers split a plan with. The split reads only the plan (keys, rank-local
sizes, the checkpoint slices each job reads), never the cache, so every task, on any host, at any time, computes the
same N slices: every entry in exactly one shard, each distinct encode in one shard, and a task run again (a retried
pod) looks up the same slice and finds what it published. Jobs the server keeps unencoded (``skipped``) are reported
by shard 0. Inside a shard, torchrun splits the slice again between its processes.

Where the index comes from (``resolve_shard``): ``--shard I/N``, else the scheduler's own variables (the ``SCHEDULERS``
table): Kubernetes' ``JOB_COMPLETION_INDEX`` (the Job's count, ``spec.completions``, is in no variable: pass
``--shard-count N``), Slurm's ``SLURM_ARRAY_TASK_ID`` with ``SLURM_ARRAY_TASK_COUNT``, ``_MIN`` and ``_STEP``. GitHub
Actions has no index variable: its matrix passes ``--shard ${{ matrix.shard }}/N``. A shard with no job (N larger than
the plan's encodes) is success with a note: the plan has work, another shard holds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

from exl3tool.errors import ConfigError
from exl3tool.plan.sharing import group_jobs, share_jobs

if TYPE_CHECKING:
    from exl3tool.plan.job import LookupJob

__all__ = ["Shard", "ShardInfo", "SCHEDULERS", "parse_shard", "resolve_shard", "shard_slice", "shard_info",
           "check_count"]


@dataclass(frozen=True)
class Scheduler:
    """A batch scheduler's variables for a task's index and the count (None: it sets none)."""

    name: str
    index: str
    count: Optional[str]
    minimum: Optional[str] = None  # the first index of the array (index = (ID - min) / step)
    step: Optional[str] = None
    count_hint: str = ""  # where the count is, when the scheduler does not say it


# Data, not branches: the variables each scheduler sets in a task (Kubernetes: the Job controller's downward API,
# kubernetes.io/docs/tasks/job/indexed-parallel-processing-static; Slurm: slurm.schedmd.com/job_array.html).
SCHEDULERS: tuple[Scheduler, ...] = (
    Scheduler("Kubernetes Indexed Job", "JOB_COMPLETION_INDEX", None,
              count_hint="the Job's spec.completions, which no variable carries"),
    Scheduler("Slurm job array", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN",
              "SLURM_ARRAY_TASK_STEP", count_hint="the array's task count"),
)


@dataclass(frozen=True)
class Shard:
    """This task's shard: ``index`` of ``count`` (0-based), and what said so (``source``, for the report)."""

    index: int
    count: int
    source: str = "--shard"

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


@dataclass(frozen=True)
class ShardInfo:
    """A shard's slice of the plan, beside the whole plan's figures (the ``shard`` object of ``--json``)."""

    index: int
    count: int
    source: str
    jobs: int  # jobs of this shard (its looked-up jobs, and the skipped ones on shard 0)
    entries: int  # looked-up jobs: entries this shard publishes or finds
    encodes: int  # distinct encodes (share groups) among them
    cost_tiles: int  # the split's cost: tiles the encoder quantizes, once per share group
    plan_jobs: int
    plan_entries: int
    plan_encodes: int
    plan_cost_tiles: int
    plan_skipped: int

    @property
    def empty(self) -> bool:
        return self.jobs == 0

    @property
    def note(self) -> str:
        """One line for stderr: which shard, from where, its share of the plan (or that it has none)."""
        head = f"shard {self.index}/{self.count} (from {self.source})"
        if self.empty:
            return (f"{head}: no job; the plan's {self.plan_encodes} encodes fill "
                    f"{min(self.count, self.plan_encodes)} of {self.count} shards, the others hold them; nothing to do here")
        return (f"{head}: {self.entries} of {self.plan_entries} entries, {self.encodes} of {self.plan_encodes} encodes, "
                f"{self.cost_tiles:,} of {self.plan_cost_tiles:,} encode tiles")

    def as_json(self) -> dict[str, Any]:
        return {"index": self.index, "count": self.count, "source": self.source, "jobs": self.jobs,
                "entries": self.entries, "encodes": self.encodes, "cost_tiles": self.cost_tiles, "empty": self.empty,
                "plan": {"jobs": self.plan_jobs, "entries": self.plan_entries, "encodes": self.plan_encodes,
                         "cost_tiles": self.plan_cost_tiles, "skipped": self.plan_skipped}}


def _index_count(index_text: str, count_text: str, what: str) -> tuple[int, int]:
    """Both as integers with 0 <= index < count; ValueError naming ``what`` otherwise."""
    try:
        index, count = int(index_text.strip()), int(count_text.strip())
    except ValueError:
        raise ValueError(f"{what}: the index and the count must be integers") from None
    if count < 1:
        raise ValueError(f"{what}: the count must be at least 1")
    if not 0 <= index < count:
        raise ValueError(f"{what}: the index must be from 0 to {count - 1} (0-based)")
    return index, count


def parse_shard(text: str) -> tuple[int, int]:
    """``I/N`` as ``(I, N)``, 0 <= I < N; ValueError with the fix otherwise.

    >>> parse_shard("2/4")
    (2, 4)
    """
    index, sep, count = text.partition("/")
    if not sep:
        raise ValueError(f"{text!r} is not INDEX/COUNT (e.g. 0/4: the first of 4 shards)")
    return _index_count(index, count, f"{text!r} is not a shard INDEX/COUNT")


def _from_scheduler(s: Scheduler, env: Mapping[str, str], shard_count: Optional[int]) -> Shard:
    raw = env[s.index].strip()
    try:
        task = int(raw)
    except ValueError:
        raise ConfigError(f"{s.index}={raw!r} (a {s.name}) is not an integer; pass --shard I/N") from None
    counted = env.get(s.count, "").strip() if s.count else ""
    if counted:
        try:
            count = int(counted)
        except ValueError:
            raise ConfigError(f"{s.count}={counted!r} is not an integer; pass --shard I/N") from None
        if shard_count is not None and shard_count != count:
            raise ConfigError(f"--shard-count {shard_count} disagrees with {s.count}={count} (a {s.name}); drop "
                              "--shard-count or pass --shard I/N")
        source = f"{s.index}, {s.count} ({s.name})"
    elif shard_count is not None:
        count, source = shard_count, f"{s.index} ({s.name}), --shard-count"
    else:
        raise ConfigError(f"{s.index}={raw} is set (a {s.name}) but not the shard count: pass --shard-count N "
                          f"({s.count_hint}) or --shard I/N")
    index = task
    if s.minimum and env.get(s.minimum, "").strip():
        try:
            first = int(env[s.minimum])
            step = int(env.get(s.step, "1").strip() or "1") if s.step else 1
        except ValueError:
            raise ConfigError(f"{s.minimum}/{s.step} are not integers; pass --shard I/N") from None
        if step < 1 or (task - first) % step:
            index = -1
        else:
            index = (task - first) // step
    if count < 1 or not 0 <= index < count:
        raise ConfigError(f"{s.index}={raw} is not task 0 to {count - 1} of {count} ({source}): a {s.name} must "
                          "number its tasks as one range (e.g. Slurm --array=0-N, any %limit); or pass --shard I/N")
    return Shard(index, count, source)


def resolve_shard(option: Optional[str], shard_count: Optional[int] = None,
                  environ: Optional[Mapping[str, str]] = None) -> Optional[Shard]:
    """This task's shard: ``--shard I/N`` (``option``), else a scheduler's variables in ``environ`` (the process's
    own environment, not the server's), else None (the whole plan).

    ``shard_count`` (``--shard-count``) gives the count the scheduler does not (Kubernetes), or must agree with the
    one it gives. ConfigError (exit 2, one line) for anything else: a count without an index, an index without a
    count, both Kubernetes' and Slurm's index set, an index outside the count.
    """
    import os

    env = os.environ if environ is None else environ
    if shard_count is not None and shard_count < 1:
        raise ConfigError(f"--shard-count {shard_count}: must be at least 1")
    if option is not None:
        try:
            index, count = parse_shard(option)
        except ValueError as exc:
            raise ConfigError(f"--shard {exc}") from None
        if shard_count is not None and shard_count != count:
            raise ConfigError(f"--shard {option} and --shard-count {shard_count} disagree; give one")
        return Shard(index, count, "--shard")
    present = [s for s in SCHEDULERS if env.get(s.index, "").strip()]
    if len(present) > 1:
        names = " and ".join(f"{s.index} ({s.name})" for s in present)
        raise ConfigError(f"both {names} are set: pass --shard I/N to say which shard this task is")
    if present:
        return _from_scheduler(present[0], env, shard_count)
    if shard_count is not None:
        variables = ", ".join(s.index for s in SCHEDULERS)
        raise ConfigError(f"--shard-count {shard_count} without an index: none of {variables} is set; pass "
                          "--shard I/N")
    return None


def check_count(shard: Shard, jobs: list["LookupJob"]) -> None:
    """ConfigError (a usage error, one line) when ``shard.count`` is more than the plan has jobs: such a count is a
    mistake (a typo, a matrix sized for another model), never a split; it is refused before ``share_jobs`` sizes
    anything by it (a count of 2**63 would not fit in memory)."""
    if shard.count <= len(jobs):
        return
    encodes = len(group_jobs([j for j in jobs if j.state != "skipped"]))
    raise ConfigError(f"shard count {shard.count} (from {shard.source}) is more than the plan's {len(jobs)} jobs "
                      f"({encodes} encodes: at most {encodes} shards hold work); pass a count from 1 to {len(jobs)}")


def shard_slice(jobs: list["LookupJob"], shard: Shard) -> list["LookupJob"]:
    """``shard``'s jobs of a plan's ``jobs`` (planned states need not be known): its share groups of the looked-up
    jobs, by ``share_jobs`` (largest encode first into the least-loaded shard, ties by digest and index), and on
    shard 0 the skipped jobs; in the plan's order. ConfigError for a count beyond the plan's jobs (``check_count``)."""
    check_count(shard, jobs)
    looked_up = [j for j in jobs if j.state != "skipped"]
    mine = {j.digest for j in share_jobs(looked_up, shard.index, shard.count)}
    return [j for j in jobs if j.digest in mine or (j.state == "skipped" and shard.index == 0)]


def shard_info(shard: Shard, plan_jobs: list["LookupJob"], mine: list["LookupJob"]) -> ShardInfo:
    """The figures of ``mine`` (``shard_slice``'s result) against the whole plan's ``plan_jobs``."""
    def figures(jobs: list["LookupJob"]) -> tuple[int, int, int]:
        looked_up = [j for j in jobs if j.state != "skipped"]
        groups = group_jobs(looked_up)
        return len(looked_up), len(groups), sum(g.tiles for g in groups)

    entries, encodes, cost = figures(mine)
    plan_entries, plan_encodes, plan_cost = figures(plan_jobs)
    return ShardInfo(shard.index, shard.count, shard.source, len(mine), entries, encodes, cost, len(plan_jobs),
                     plan_entries, plan_encodes, plan_cost, sum(1 for j in plan_jobs if j.state == "skipped"))
