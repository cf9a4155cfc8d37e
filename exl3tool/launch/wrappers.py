"""Wrappers before the server's command that change its filesystem, user, host or environment: one table (data),
and the walk that follows them.

A wrapper word before ``vllm serve`` (``proot -R ROOTFS -b HOST:GUEST``, ``env -i``, ``sudo -u USER``, ``ssh HOST``)
decides what the server sees: its root and bind mounts, its environment, its home, its host. Each known wrapper is
either **followed** (its root and binds become the server's filesystem view, a ``PathMap``, as a container's volumes
do; its environment rules are applied; a user's home comes from this machine's passwd) or **refused** in one line
naming it and what to give instead: never a plan on this host's paths for a guest's. ``docs/launch.md`` lists them,
each with the public file it is modelled on. Words this table does not know (``setsid``, ``./launcher``,
``numactl ...``) change none of that and stay listed as ignored, as before.
"""

from __future__ import annotations

import os
import posixpath
import pwd
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

from exl3tool.errors import ConfigError
from exl3tool.launch.container import Mount, PathMap
from exl3tool.launch.env import EnvValue

__all__ = ["Wrapper", "WRAPPERS", "Guest", "follow", "wrapper_named", "refusal_in", "ENTRYPOINT_PASS_THROUGH",
           "entrypoint_passes", "traced_view"]

ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)

# option roles: how many words each takes after the option
_TAKES = {"flag": 0, "login": 0, "keepenv": 0, "sethome": 0, "clearenv": 0, "nohome": 0, "contain": 0,
          "containall": 0, "nochdir": 0,
          "value": 1, "root": 1, "rootR": 1, "rootS": 1, "bind": 1, "binds": 1, "mountspec": 1, "cwd": 1,
          "setenv": 1, "unsetenv": 1, "envfile": 1, "dotenv": 1, "nodotenv": 0, "user": 1, "userspec": 1, "home": 1, "refuse": 1,
          "mask": 1, "refuseflag": 0,
          "bind2": 2, "mask2": 2, "setenv2": 2, "value2": 2}
_INSTEAD = ("run exl3tool where the server runs (inside that environment), or give the launch as the server runs it "
            "there: its DRY_RUN output (--launch-file), or the server's vllm serve line with MODEL and --server-path "
            "for the paths it sees")


@dataclass(frozen=True)
class Wrapper:
    """One wrapper command: followed (its options' roles say what it changes) or refused (``why``, ``instead``)."""

    names: tuple[str, ...]
    follow: bool
    options: Mapping[str, str] = field(default_factory=dict)  # spelling -> role (see _TAKES)
    positionals: tuple[str, ...] = ()  # roles of the words between its options and its command ("?": optional)
    assignments: bool = False  # NAME=VALUE words before its command are its command's environment (env, sudo)
    env: str = "keep"  # keep | sudo | su | user: how its command's environment and HOME come from the caller's
    subcommands: Mapping[str, str] = field(default_factory=dict)  # word -> "" (followed) or why it is refused
    why: str = ""  # refused: what it does that exl3tool cannot see
    instead: str = _INSTEAD
    modelled_on: str = ""  # the public file this row is written from
    traced: bool = False  # its view is made by tracing (ptrace), not by the kernel: /proc/PID/root does not show it


_PROOT_R = ("/etc/host.conf", "/etc/hosts", "/etc/hosts.equiv", "/etc/mtab", "/etc/netgroup", "/etc/networks",
            "/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/etc/resolv.conf", "/etc/localtime", "/dev", "/sys",
            "/proc", "/tmp", "/run", "/var/run/dbus/system_bus_socket")  # and $HOME and the rootfs itself
_PROOT_S = ("/etc/host.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/resolv.conf", "/dev", "/sys", "/proc",
            "/tmp", "/run/shm")

_APPTAINER_OPTIONS = {
    "-B": "binds", "--bind": "binds", "--mount": "mountspec", "-H": "home", "--home": "home", "--no-home": "nohome",
    "-c": "contain", "--contain": "contain", "-C": "containall", "--containall": "containall", "--compat": "containall",
    "-e": "clearenv", "--cleanenv": "clearenv", "--env": "setenv", "--env-file": "envfile", "--pwd": "cwd",
    "-W": "value", "--workdir": "value", "-S": "mask", "--scratch": "mask", "--no-mount": "value",
    "-o": "value", "--overlay": "value", "--app": "value", "--hostname": "value", "--dns": "value",
    "--network": "value", "--net-args": "value", "--network-args": "value", "--security": "value",
    "--apply-cgroups": "value", "--cpus": "value", "--memory": "value", "--memory-swap": "value",
    "--memory-reservation": "value", "--cpu-shares": "value", "--cpuset-cpus": "value", "--cpuset-mems": "value",
    "--blkio-weight": "value", "--oom-kill-disable": "flag", "--pids-limit": "value", "--add-caps": "value",
    "--drop-caps": "value", "--fusemount": "value", "--userns": "flag", "-u": "flag", "--nv": "flag",
    "--nvccli": "flag", "--rocm": "flag", "-w": "flag", "--writable": "flag", "--writable-tmpfs": "flag",
    "-f": "flag", "--fakeroot": "flag", "--no-privs": "flag", "--keep-privs": "flag", "--net": "flag",
    "-i": "flag", "--ipc": "flag", "-p": "flag", "--pid": "flag", "--uts": "flag", "--no-init": "flag",
    "--no-umask": "flag", "--no-eval": "flag", "--no-https": "flag", "--disable-cache": "flag",
    "--unsquash": "flag", "--cleanenv-all": "clearenv", "--boot": "flag", "--sharens": "flag", "-s": "flag",
    "--silent": "flag", "-q": "flag", "--quiet": "flag", "-d": "flag", "--debug": "flag", "-v": "flag",
    "--verbose": "flag",
}
_COMPOSE = ("the server is a compose service, whose environment, volumes, entrypoint and command come from its "
            "compose files (merged with -f, an override file and COMPOSE_FILE) and its .env; give it with --compose "
            "FILE --service NAME (`docker compose config` prints the merged file)")
_RUNNER_EXEC = ("the server runs in a container that is already running, whose volumes and environment exl3tool "
                "does not see")

# uv's global options and `uv run`'s (uv's CLI reference): the env files, the folder it changes to, the rest change
# which Python environment runs the command, not what the server reads
_UV_VALUE = ("--color", "--allow-insecure-host", "--project", "--config-file", "--cache-dir", "--python-preference",
             "--preview-features", "--extra", "--no-extra", "--group", "--no-group", "--only-group", "--with", "-w",
             "--with-editable", "--with-requirements", "--package", "--python", "-p", "--max-recursion-depth",
             "--no-build-isolation-package", "--index", "--default-index", "--index-url", "-i", "--extra-index-url",
             "--find-links", "-f", "--upgrade-package", "-P", "--reinstall-package", "--index-strategy",
             "--keyring-provider", "--resolution", "--prerelease", "--fork-strategy", "--config-setting", "-C",
             "--config-settings-package", "--exclude-newer", "--exclude-newer-package", "--link-mode",
             "--refresh-package", "--no-build-package", "--no-binary-package", "--no-sources-package")
_UV_FLAG = ("-q", "--quiet", "-v", "--verbose", "--native-tls", "--offline", "--no-progress", "--no-config", "-n",
            "--no-cache", "--no-python-downloads", "--managed-python", "--no-managed-python", "--preview",
            "--no-preview", "--all-extras", "--no-dev", "--dev", "--only-dev", "--no-default-groups", "--all-groups",
            "--isolated", "--active", "--no-active", "--no-sync", "--locked", "--frozen", "--exact", "--no-editable",
            "--no-project", "--all-packages", "--show-resolution", "--no-build-isolation", "--no-index", "-U",
            "--upgrade", "--reinstall", "--pre", "--compile-bytecode", "--no-sources", "--refresh", "--no-build",
            "--no-binary")
_UV_OPTIONS = {**{o: "value" for o in _UV_VALUE}, **{o: "flag" for o in _UV_FLAG}, "--env-file": "dotenv",
               "--no-env-file": "nodotenv", "--directory": "cwd"}

WRAPPERS: tuple[Wrapper, ...] = (
    Wrapper(("proot",), True, {
        "-r": "root", "--rootfs": "root", "-R": "rootR", "-S": "rootS", "-b": "bind", "--bind": "bind",
        "-m": "bind", "--mount": "bind", "-w": "cwd", "--pwd": "cwd", "--cwd": "cwd", "-q": "value",
        "--qemu": "value", "-v": "value", "--verbose": "value", "-k": "value", "--kernel-release": "value",
        "-i": "value", "--change-id": "value", "-p": "value", "--port": "value", "-0": "flag", "--root-id": "flag",
        "-n": "flag", "--netcoop": "flag", "-L": "flag", "--link2symlink": "flag", "--kill-on-exit": "flag",
        "--sysvipc": "flag", "--ashmem-memfd": "flag", "-H": "flag", "-P": "flag", "-V": "flag",
    }, modelled_on="malaiwah/qwen38-27b-exl3 tools/ggrun.sh (proot -R ROOTFS -b HOST:GUEST ... /usr/bin/env -i "
                   "... \"$@\"); options from proot-me/proot doc/proot/manual.rst", traced=True),
    Wrapper(("chroot",), True, {"--userspec": "userspec", "--groups": "value", "--skip-chdir": "nochdir"},
            positionals=("root",), modelled_on="coreutils chroot(1)"),
    Wrapper(("unshare",), True, {
        "-R": "root", "--root": "root", "-w": "cwd", "--wd": "cwd", "-m": "flag", "--mount": "flag", "-u": "flag",
        "--uts": "flag", "-i": "flag", "--ipc": "flag", "-n": "flag", "--net": "flag", "-p": "flag", "--pid": "flag",
        "-U": "flag", "--user": "flag", "-C": "flag", "--cgroup": "flag", "-T": "flag", "--time": "flag",
        "-f": "flag", "--fork": "flag", "--kill-child": "flag", "--mount-proc": "flag", "--map-user": "value",
        "--map-group": "value", "-r": "flag", "--map-root-user": "flag", "-c": "flag", "--map-current-user": "flag",
        "--map-auto": "flag", "--map-users": "value", "--map-groups": "value", "--propagation": "value",
        "--setgroups": "value", "-S": "value", "--setuid": "value", "-G": "value", "--setgid": "value",
        "--monotonic": "value", "--boottime": "value", "-l": "flag", "--load-interp": "value",
    }, modelled_on="util-linux unshare(1)"),
    Wrapper(("bwrap",), True, {
        "--bind": "bind2", "--bind-try": "bind2", "--dev-bind": "bind2", "--dev-bind-try": "bind2",
        "--ro-bind": "bind2", "--ro-bind-try": "bind2", "--tmpfs": "mask", "--proc": "mask", "--dev": "mask",
        "--dir": "mask", "--mqueue": "mask", "--symlink": "mask2", "--file": "mask2", "--bind-data": "mask2",
        "--ro-bind-data": "mask2", "--bind-fd": "mask2", "--ro-bind-fd": "mask2", "--remount-ro": "value",
        "--chdir": "cwd", "--setenv": "setenv2", "--unsetenv": "unsetenv", "--clearenv": "clearenv",
        "--chmod": "value2", "--perms": "value", "--size": "value", "--uid": "value", "--gid": "value",
        "--hostname": "value", "--argv0": "value", "--lock-file": "value", "--sync-fd": "value",
        "--userns": "value", "--userns2": "value", "--pidns": "value", "--seccomp": "value",
        "--add-seccomp-fd": "value", "--block-fd": "value", "--userns-block-fd": "value", "--info-fd": "value",
        "--json-status-fd": "value", "--exec-label": "value", "--file-label": "value", "--cap-add": "value",
        "--cap-drop": "value", "--unshare-user": "flag", "--unshare-user-try": "flag", "--unshare-ipc": "flag",
        "--unshare-pid": "flag", "--unshare-net": "flag", "--unshare-uts": "flag", "--unshare-cgroup": "flag",
        "--unshare-cgroup-try": "flag", "--unshare-all": "flag", "--share-net": "flag", "--new-session": "flag",
        "--die-with-parent": "flag", "--as-pid-1": "flag", "--disable-userns": "flag",
        "--assert-userns-disabled": "flag", "--args": "refuse", "--overlay-src": "refuse", "--overlay": "refuse",
        "--tmp-overlay": "refuse", "--ro-overlay": "refuse",
    }, modelled_on="bubblewrap bwrap(1) (an empty root: only what it binds is the host's)"),
    Wrapper(("env",), True, {
        "-i": "clearenv", "--ignore-environment": "clearenv", "-": "clearenv", "-u": "unsetenv",
        "--unset": "unsetenv", "-C": "cwd", "--chdir": "cwd", "-0": "flag", "--null": "flag", "-v": "flag",
        "--debug": "flag", "-S": "refuse", "--split-string": "refuse", "--block-signal": "flag",
        "--default-signal": "flag", "--ignore-signal": "flag", "--list-signal-handling": "flag",
    }, assignments=True, modelled_on="malaiwah/qwen38-27b-exl3 tools/ggrun.sh (/usr/bin/env -i PATH=... HOME=/root "
                                      "VLLM_...=...); coreutils env(1)"),
    Wrapper(("sudo",), True, {
        "-u": "user", "--user": "user", "-E": "keepenv", "--preserve-env": "keepenv", "-H": "sethome",
        "--set-home": "sethome", "-i": "login", "--login": "login", "-s": "flag", "--shell": "flag",
        "-g": "value", "--group": "value", "-n": "flag", "--non-interactive": "flag", "-b": "flag",
        "--background": "flag", "-k": "flag", "--reset-timestamp": "flag", "-S": "flag", "--stdin": "flag",
        "-A": "flag", "--askpass": "flag", "-B": "flag", "--bell": "flag", "-P": "flag",
        "--preserve-groups": "flag", "-p": "value", "--prompt": "value", "-C": "value", "--close-from": "value",
        "-D": "cwd", "--chdir": "cwd", "-R": "root", "--chroot": "root", "-r": "value", "--role": "value",
        "-t": "value", "--type": "value", "-T": "value", "--command-timeout": "value", "-h": "refuse",
        "--host": "refuse",
    }, assignments=True, env="sudo", modelled_on="sudo(8), sudoers(5) env_reset"),
    Wrapper(("su", "runuser"), True, {
        "-": "login", "-l": "login", "--login": "login", "-m": "keepenv", "-p": "keepenv",
        "--preserve-environment": "keepenv", "-u": "user", "--user": "user", "-s": "value", "--shell": "value",
        "-g": "value", "--group": "value", "-G": "value", "--supp-group": "value", "-f": "flag", "--fast": "flag",
        "-P": "flag", "--pty": "flag", "-w": "value", "--whitelist-environment": "value",
    }, positionals=("user?",), env="su", modelled_on="util-linux su(1), runuser(1)"),
    Wrapper(("gosu", "su-exec", "s6-setuidgid"), True, positionals=("user",), env="user",
            modelled_on="tianon/gosu README (exec gosu USER COMMAND in entrypoints)"),
    Wrapper(("setpriv", "chpst"), True, {
        "--reuid": "user", "--regid": "value", "--init-groups": "flag", "--clear-groups": "flag",
        "--keep-groups": "flag", "--groups": "value", "--inh-caps": "value", "--ambient-caps": "value",
        "--bounding-set": "value", "--nnp": "flag", "--no-new-privs": "flag", "--securebits": "value",
        "--pdeathsig": "value", "--selinux-label": "value", "--apparmor-profile": "value", "--reset-env": "refuseflag",
        "-u": "user", "-U": "value",
    }, env="user", modelled_on="util-linux setpriv(1), runit chpst(8)"),
    Wrapper(("apptainer", "singularity"), True, _APPTAINER_OPTIONS, positionals=("subcommand", "image"),
            subcommands={"exec": "", "run": "the server is the image's runscript, which exl3tool does not read "
                         "(`apptainer exec IMAGE vllm serve ...` names it)", "shell": "it starts an interactive shell",
                         "instance": "it starts a background instance whose command exl3tool does not see",
                         "test": "it runs the image's test script"},
            modelled_on="princeton-ddss/blackfish src/app/templates/text_generation_slurm.sh (apptainer run --nv "
                        "--bind MODEL_DIR:/data IMAGE.sif --model /data/...); apptainer exec --bind"),
    Wrapper(("uv",), True, _UV_OPTIONS, positionals=("subcommand",), subcommands={"run": ""},
            modelled_on="uv run (crates/uv/src/commands/project/run.rs: each --env-file loaded with dotenvy::from_path, "
                        "last file first, never over a variable already set; --env-file and UV_ENV_FILE split at "
                        "spaces, --no-env-file and UV_NO_ENV_FILE turn it off)"),
    Wrapper(("tmux",), False, why="the server runs in a tmux session, whose environment is the tmux server's global "
            "environment (this command's only when no tmux server runs yet; then its update-environment list and -e "
            "values), its command string run by tmux's default-shell", instead="give the command the session runs "
            "with --launch, with the environment it gets there, or --pid of the server process",
            modelled_on="tmux(1) new-session, ENVIRONMENT"),
    Wrapper(("docker-compose", "podman-compose"), False, why=_COMPOSE, instead="give the compose file as the "
            "server's launch", modelled_on="docker compose run SERVICE COMMAND (compose's run and up)"),
    Wrapper(("ssh", "mosh"), False, why="the server runs on another host, whose files and environment are not this "
            "machine's", instead="run exl3tool on that host (or give its launch there with --launch-file)",
            modelled_on="OpenSSH ssh(1): ssh HOST COMMAND"),
    Wrapper(("srun", "sbatch", "salloc", "mpirun", "mpiexec"), False,
            why="the server runs on a node of the cluster, with the node's local paths and the job's environment",
            instead="run exl3tool inside the allocation (srun exl3tool cache warm --launch ...) so it reads the "
                    "node's view", modelled_on="Slurm srun(1)"),
    Wrapper(("systemd-run",), False, why="the server runs as a systemd unit, with the manager's environment and "
            "--setenv/-p Environment= values, not this shell's", instead="give the unit's command and environment "
            "(ExecStart= as --launch, Environment= lines with --env-file)", modelled_on="systemd-run(1)"),
    Wrapper(("nsenter",), False, why="the server runs in another process's namespaces (its mounts)",
            instead="give that process with --pid PID, whose root and mounts exl3tool reads from /proc",
            modelled_on="util-linux nsenter(1)"),
    Wrapper(("flatpak-spawn", "flatpak", "toolbox", "distrobox", "distrobox-enter", "machinectl", "schroot",
             "firejail", "fakechroot", "proot-distro", "lxc", "lxc-attach", "doas", "pkexec"), False,
            why="the server runs in an environment (a sandbox, a container, another user's session) whose files, "
                "user and environment exl3tool does not model", modelled_on="flatpak-spawn(1), toolbox(1), "
                                                                            "firejail(1), doas(1)"),
    Wrapper(("docker", "podman", "nerdctl", "kubectl"), False, subcommands={"exec": _RUNNER_EXEC,
                                                                           "run": "the server runs in a new pod",
                                                                           "compose": _COMPOSE},
            why=_RUNNER_EXEC, instead="give the server's container launch (its docker/podman run line or compose "
            "service), or --pid of the server process", modelled_on="docker exec CONTAINER vllm serve ..."),
)
_BY_NAME = {n: w for w in WRAPPERS for n in w.names}

# image entrypoints that run their arguments unchanged (after their own setup): the command is what follows them
ENTRYPOINT_PASS_THROUGH: dict[str, str] = {
    "/opt/nvidia/nvidia_entrypoint.sh": "NVIDIA's base images: prints its banner, then runs its arguments",
    "tini": "an init that runs its arguments (tini [OPTIONS] [--] COMMAND)",
    "dumb-init": "an init that runs its arguments (dumb-init [OPTIONS] COMMAND)",
}


def entrypoint_passes(entrypoint: list[str]) -> tuple[list[str], str]:
    """An image's entrypoint without the pass-through wrapper it starts with (and that wrapper's options), and
    what that wrapper does ("" when it is not one)."""
    first = entrypoint[0] if entrypoint else ""
    why = ENTRYPOINT_PASS_THROUGH.get(first) or ENTRYPOINT_PASS_THROUGH.get(first.rsplit("/", 1)[-1], "")
    if not why:
        return entrypoint, ""
    rest = entrypoint[1:]
    while rest and rest[0].startswith("-"):
        done = rest[0] == "--"
        rest = rest[1:]
        if done:
            break
    return rest, f"runs its arguments ({why})"


def wrapper_named(word: str) -> Optional[Wrapper]:
    """The table's row for a command word (by its base name), or None."""
    return _BY_NAME.get(word.rsplit("/", 1)[-1])


@dataclass
class Guest:
    """What the wrappers walked so far give the server: its own variables, whether the launching environment
    reaches it, its filesystem seen from here, its working directory, and why its HOME is unknown (if so)."""

    env: dict[str, EnvValue] = field(default_factory=dict)
    cleared: bool = False  # the launching environment (below env) does not reach the server
    hidden: set[str] = field(default_factory=set)  # names removed from that environment (env -u, a user's HOME)
    paths: PathMap = field(default_factory=PathMap)
    workdir: Optional[str] = None
    home_unknown: str = ""  # why the server's HOME is not known here ("": it is)
    image_note: str = ""  # an image whose environment was not read (apptainer)
    notes: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)  # words no row names (wrappers that change none of this)
    moved: str = ""  # the wrapper that changed the filesystem ("": none)

    def get(self, name: str, environ: Mapping[str, str]) -> Optional[str]:
        """The value the command run now sees for ``name``."""
        if name in self.env:
            return self.env[name].value
        if self.cleared or name in self.hidden:
            return None
        return environ.get(name)

    def environ(self, below: Mapping[str, str]) -> dict[str, str]:
        """The whole environment the command run now gets, ``below`` being the one the wrappers started with."""
        out = {} if self.cleared else {k: v for k, v in below.items() if k not in self.hidden}
        out.update({k: v.value for k, v in self.env.items()})
        return out

    def set(self, name: str, value: str, detail: str) -> None:
        self.env[name] = EnvValue(value, "launch env", detail)
        self.hidden.discard(name)
        if name == "HOME":
            self.home_unknown = ""

    def clear(self) -> None:
        self.env.clear()
        self.cleared = True
        self.hidden.clear()


def traced_view(argv: Sequence[str], *, environ: Mapping[str, str], cwd: str) -> Optional[Guest]:
    """The filesystem view a tracing wrapper's command line (``proot -R ROOT -b ...``, a running server's parent)
    gives its command, or None when ``argv`` is not one."""
    row = wrapper_named(argv[0]) if argv else None
    if row is None or not row.traced:
        return None
    guest = Guest()
    _apply(row, list(argv), 0, guest, environ, cwd, "", False)
    return guest if guest.moved else None


def refusal_in(words: Sequence[str]) -> Optional[str]:
    """The one-line refusal for a refused wrapper at the first command position of ``words``, or None; for a launch
    in which no server was found (``ssh HOST 'cd /srv && vllm serve ...'``, ``apptainer run IMAGE --model ...``)."""
    for i, word in enumerate(words):
        if ASSIGNMENT.match(word):
            continue
        row = wrapper_named(word)
        reason = None if row is None else _reason(row, words[i + 1:])
        return _refusal(row, list(words[i:]), reason) if row is not None and reason else None
    return None


def _reason(row: Wrapper, rest: Sequence[str]) -> Optional[str]:
    """Why this use of the wrapper is refused; "" when it is followed; None when it starts no command exl3tool
    knows of (``docker ps``)."""
    if not row.subcommands:
        return "" if row.follow else row.why
    sub = _subcommand(row, rest)
    if sub in row.subcommands:
        return row.subcommands[sub] or ("" if row.follow else row.why)
    if not row.follow:
        return None
    return f"`{row.names[0]} {sub or ''}` is not a way of starting a command that exl3tool follows"


def _subcommand(row: Wrapper, rest: Sequence[str]) -> Optional[str]:
    if not row.subcommands:
        return None
    skip = False
    for word in rest:
        if skip:
            skip = False
        elif word.startswith("-"):
            skip = _TAKES.get(row.options.get(word.partition("=")[0], "flag"), 0) > 0 and "=" not in word
        else:
            return word
    return None


def _refusal(row: Wrapper, words: list[str], why: str) -> str:
    shown = " ".join(words[:4]) + (" ..." if len(words) > 4 else "")
    return f"the launch starts the server through `{shown}`: {why}; exl3tool does not follow it: {row.instead}"


def _home(user: str, where: str, guest: Guest, inside: bool) -> None:
    """The server's HOME becomes ``user``'s: from this machine's passwd (a launch on this host), else unknown."""
    guest.env.pop("HOME", None)
    guest.hidden.add("HOME")
    if not inside:
        try:
            guest.set("HOME", pwd.getpwnam(user).pw_dir, f"{where}: the home of {user} (this machine's passwd)")
            return
        except KeyError:
            pass
    guest.home_unknown = (f"{where}: the server runs as {user}, whose home is not known here "
                          f"({'the image' if inside else 'this machine'} has no such user in its passwd exl3tool "
                          "can read), so its HOME and what defaults under it are not known")


def _bind_spec(spec: str, cwd: str, sep: str = ":") -> Optional[tuple[str, str]]:
    """``HOST[:GUEST[:opts]]`` (proot, apptainer): (host path, guest path), the guest path the host's when absent."""
    parts = spec.split(sep)
    host = parts[0]
    guest = parts[1] if len(parts) > 1 and parts[1] else host
    if not host:
        return None
    host = posixpath.normpath(posixpath.join(cwd, os.path.expanduser(host)))
    return host, posixpath.normpath(posixpath.join(cwd, guest.rstrip("!") or "/"))  # relative: from cwd (proot)


def follow(words: Sequence[str], guest: Guest, *, environ: Mapping[str, str], cwd: str, entry: str,
           inside: bool = False) -> Guest:
    """Walk the wrapper words before the server's command (or before a shell that runs its script) into ``guest``.

    ``environ`` is the environment the words start with (below ``guest.env``), ``cwd`` the directory they run in,
    ``inside`` True when they run inside a container's view (a root or bind change there is refused, a user's
    home is the image's). Raises ConfigError for a refused wrapper or an option of a followed one that exl3tool does
    not know (where its command starts cannot be told then).
    """
    i = 0
    words = list(words)
    while i < len(words):
        word = words[i]
        m = ASSIGNMENT.match(word)
        if m:
            guest.set(m.group(1), m.group(2), f"{m.group(1)}=... before {entry}")
            i += 1
            continue
        row = wrapper_named(word)
        if row is None:
            guest.ignored.append(word)
            i += 1
            continue
        reason = _reason(row, words[i + 1:])
        if reason is None:  # `docker ps` and the like: not a way to start a server, an unknown word as before
            guest.ignored.append(word)
            i += 1
            continue
        if reason:
            raise ConfigError(_refusal(row, words[i:], reason))
        i = _apply(row, words, i, guest, environ, cwd, entry, inside)
    return guest


def _apply(row: Wrapper, words: list[str], at: int, guest: Guest, environ: Mapping[str, str], cwd: str, entry: str,
           inside: bool) -> int:
    """Read one followed wrapper's options from ``words[at]`` and apply them to ``guest``; the index of its
    command."""
    name = words[at].rsplit("/", 1)[-1]
    got: list[tuple[str, tuple[str, ...], str]] = []  # (role, values, spelling)
    j = at + 1

    def unknown(option: str) -> ConfigError:
        return ConfigError(f"the launch's `{name} {option}`: an option of {name} exl3tool does not know, so what it "
                           f"changes and where its command starts cannot be told; drop it, or {_INSTEAD}")

    def options(j: int) -> tuple[int, bool]:
        """Read options from ``words[j]``: the index after them, and whether ``--`` ended them."""
        while j < len(words):
            word = words[j]
            if word == "--":
                return j + 1, True
            if word == "-" and "-" in row.options:
                got.append((row.options["-"], (), "-"))
                j += 1
                continue
            if not word.startswith("-") or word == "-":
                return j, False
            if word.startswith("--"):
                spelled, eq, inline = word.partition("=")
                role = row.options.get(spelled)
                if role is None:
                    raise unknown(spelled)
                take = _TAKES[role]
                if eq and take == 0:  # --preserve-env=LIST, --mount-proc=DIR: an optional value
                    got.append((role + "=", (inline,), spelled))
                    j += 1
                    continue
                values = [inline] if eq else []
                j += 1
                while len(values) < take:
                    if j >= len(words):
                        raise ConfigError(f"the launch's `{name} {spelled}` has no value ({name} refuses it too)")
                    values.append(words[j])
                    j += 1
                got.append((role, tuple(values), spelled))
                continue
            chars = word[1:]  # a short option, or a cluster of them (-Eu USER, -Urmnpf)
            k = 0
            j += 1
            while k < len(chars):
                spelled = "-" + chars[k]
                role = row.options.get(spelled)
                if role is None:
                    raise unknown(spelled)
                take = _TAKES[role]
                if take == 0:
                    got.append((role, (), spelled))
                    k += 1
                    continue
                rest = chars[k + 1:].removeprefix("=")
                values = [rest] if rest else []
                while len(values) < take:
                    if j >= len(words):
                        raise ConfigError(f"the launch's `{name} {spelled}` has no value ({name} refuses it too)")
                    values.append(words[j])
                    j += 1
                got.append((role, tuple(values), spelled))
                break
        return j, False

    positional: dict[str, str] = {}
    ended = False
    for role in row.positionals:
        if not ended:
            j, ended = options(j)
        key = role.rstrip("?")
        if role.endswith("?"):  # su [USER]: absent after --, after -u USER, or before the next command word
            if ended or any(r == key for r, _, _ in got) or j >= len(words) or ASSIGNMENT.match(words[j]) \
                    or wrapper_named(words[j]) or words[j].startswith("-"):
                continue
        elif j >= len(words):
            raise ConfigError(f"the launch's `{name}` has no {key} ({name} refuses it too)")
        positional[key] = words[j]
        j += 1
    if not ended:
        j, ended = options(j)
    assigned: list[tuple[str, str]] = []
    while row.assignments and j < len(words) and (m := ASSIGNMENT.match(words[j])):
        assigned.append((m.group(1), m.group(2)))
        j += 1
    shown = " ".join(words[at:j])
    for role, values, spelled in got:
        if role in ("refuse", "refuseflag"):
            raise ConfigError(f"the launch's `{name} {spelled}` is not followed by exl3tool (what it changes cannot "
                              f"be told here); drop it, or {_INSTEAD}")
    _environment(row, name, shown, got, positional, guest, environ, inside)
    for role, values, _ in got:
        if role == "unsetenv":
            guest.env.pop(values[0], None)
            guest.hidden.add(values[0])
        elif role == "setenv":
            for item in values[0].split(",") if name in ("apptainer", "singularity") else values:
                key, eq, value = item.partition("=")
                if eq:
                    guest.set(key, value, f"{name} --env {key}")
        elif role == "setenv2":
            guest.set(values[0], values[1], f"{name} --setenv {values[0]}")
        elif role == "envfile":
            from exl3tool.launch.env import read_env_file

            for key, item in read_env_file(posixpath.join(cwd, values[0]), environ=dict(environ),
                                           label=f"the launch's {name} --env-file", source="launch env",
                                           dry_run_form=False).items():
                guest.set(key, item.value, item.detail)
    for key, value in assigned:
        guest.set(key, value, f"{key}=... after {name} before {entry}")
    _filesystem(row, name, shown, got, positional, guest, environ, cwd, inside)
    if any(r in ("dotenv", "nodotenv") for r in row.options.values()):
        _dotenv(name, got, guest, environ, posixpath.join(cwd, guest.workdir or "."))
    return j


# NAME=VALUE with a plain value, a single-quoted one (literal), or a double-quoted one without $, \\ or " (literal too)
_PLAIN_DOTENV = re.compile(r"^(?:export[ \t]+)?([A-Za-z_][A-Za-z0-9_]*)=(?:([^\s'\"`$\\#]*)|'([^']*)'|\"([^\"$\\`]*)\")$")


def _dotenv(name: str, got, guest: Guest, environ: Mapping[str, str], cwd: str) -> None:
    """``uv run``'s env files: ``--env-file`` values (else ``UV_ENV_FILE``), split at spaces, each loaded without
    overriding a variable already set, the last file first (so it wins over earlier ones, and the environment over
    all), unless ``--no-env-file`` or ``UV_NO_ENV_FILE``. Only ``NAME=VALUE`` lines whose value dotenv takes
    literally are read (``export`` allowed; a bare word, ``'...'``, or ``"..."`` without ``$``, ``\\``, a backtick):
    an escape, a ``$`` substitution or a comment after the value is dotenv syntax exl3tool does not model, refused
    naming the line."""
    if any(r == "nodotenv" for r, _, _ in got) or \
            (guest.get("UV_NO_ENV_FILE", environ) or "").strip().lower() in ("1", "true", "yes", "on", "y", "t"):
        return
    given = [v[0] for r, v, _ in got if r == "dotenv"]
    how = f"{name} --env-file"
    if not given and guest.get("UV_ENV_FILE", environ):
        given, how = [guest.get("UV_ENV_FILE", environ) or ""], "UV_ENV_FILE"
    files = [f for value in given for f in value.split(" ") if f]
    for file in reversed(files):
        path = posixpath.join(cwd, os.path.expanduser(file))
        try:
            with open(path, encoding="utf-8") as fh:
                lines = fh.read().splitlines()
        except OSError as exc:
            raise ConfigError(f"the launch's `{how} {file}`: cannot read {path} ({exc.strerror or exc}); {name} "
                              "refuses it too") from None
        for number, line in enumerate(lines, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            m = _PLAIN_DOTENV.match(text)
            if m is None:
                raise ConfigError(f"the launch's `{how} {file}` line {number}: {text[:80]!r} is dotenv syntax exl3tool "
                                  "does not read (escapes, $ substitution, a comment or an unquoted space in the value); "
                                  f"write it as plain NAME=VALUE, or give the variable before {name}")
            if guest.get(m.group(1), environ) is None:
                value = next(v for v in m.groups()[1:] if v is not None)
                guest.set(m.group(1), value, f"{how} {file} line {number}")


def _environment(row: Wrapper, name: str, shown: str, got, positional: dict[str, str], guest: Guest,
                 environ: Mapping[str, str], inside: bool) -> None:
    roles = {r for r, _, _ in got}
    user = next((v[0] for r, v, _ in got if r == "user"), positional.get("user"))
    if "clearenv" in roles or "containall" in roles:
        home = guest.get("HOME", environ)
        guest.clear()
        if name in ("apptainer", "singularity") and home is not None:  # apptainer sets HOME in a clean env
            guest.set("HOME", home, f"{name} --cleanenv (it keeps HOME)")
        guest.notes.append(f"`{shown}` clears the environment: the server gets only the variables set after it")
    if row.env == "sudo":
        target = user or "root"
        keep = "keepenv" in roles and "login" not in roles
        kept = [v[0] for r, v, _ in got if r == "keepenv="]  # --preserve-env=A,B: those kept, the rest reset
        if not keep:
            saved = {k: guest.get(k, environ) for n in kept for k in n.split(",")}
            guest.clear()
            for key, value in saved.items():
                if value is not None:
                    guest.set(key, value, f"{name} --preserve-env={key}")
            guest.notes.append(f"`{shown}` resets the environment (sudoers' env_reset): the server gets HOME, USER, "
                               "PATH of the target user and the variables set after it")
        if not keep or "sethome" in roles:
            _home(target, f"`{shown}`", guest, inside)
        else:
            guest.notes.append(f"`{shown}` keeps this environment, HOME included (unless sudoers sets "
                               "always_set_home)")
    elif row.env == "su":
        target = user or "root"
        if "login" in roles:
            term = guest.get("TERM", environ)
            guest.clear()
            if term is not None:
                guest.set("TERM", term, f"{name} --login keeps TERM")
            guest.notes.append(f"`{shown}` starts a login shell with a fresh environment")
            _home(target, f"`{shown}`", guest, inside)
        elif "keepenv" not in roles:
            _home(target, f"`{shown}`", guest, inside)
    elif row.env == "user":
        target = user or "another user"
        guest.env.pop("HOME", None)
        guest.hidden.add("HOME")
        guest.home_unknown = (f"`{shown}`: the server runs as {target}, and how {name} sets its HOME is not modelled "
                              "by exl3tool, so its HOME and what defaults under it are not known")
    spec = next((v[0] for r, v, _ in got if r == "userspec"), None)
    if spec is not None:  # chroot --userspec: the uid changes, the environment does not
        guest.notes.append(f"`{shown}` runs the server as {spec}; its environment (HOME included) is unchanged")


def _filesystem(row: Wrapper, name: str, shown: str, got, positional: dict[str, str], guest: Guest,
                environ: Mapping[str, str], cwd: str, inside: bool) -> None:
    roots = [(r, v[0]) for r, v, _ in got if r in ("root", "rootR", "rootS")]
    if "root" in positional:
        roots.append(("root", positional["root"]))
    binds: list[Mount] = []
    isolated = False
    root: Optional[str] = None
    for role, value in roots:
        root = posixpath.normpath(posixpath.join(cwd, value))
        if role in ("rootR", "rootS"):
            home = guest.get("HOME", environ)
            for path in (*(_PROOT_R if role == "rootR" else _PROOT_S), *([home] if home else []), root):
                if os.path.exists(path):  # proot adds these only where they exist (new_binding, must_exist off)
                    binds.append(Mount(path, posixpath.normpath(path), f"{name} {'-R' if role == 'rootR' else '-S'}"))
    workdir: Optional[str] = None
    no_deref: set[str] = set()  # proot guest paths ending in "!": their last component is not dereferenced
    for role, values, spelled in got:
        if role == "bind":
            spec = _bind_spec(values[0], cwd)
            if spec and not os.path.exists(spec[0]):  # proot: realpath of the host part fails, the binding dropped
                guest.notes.append(f"`{name} {spelled} {values[0]}`: {spec[0]} does not exist here, so {name} skips "
                                   f"that binding (\"can't sanitize binding\") and the server's {spec[1]} is its "
                                   "root's own")
            elif spec:
                binds.append(Mount(spec[0], spec[1], f"{spelled} {values[0]}"))
                if values[0].endswith("!"):
                    no_deref.add(spec[1])
        elif role == "binds":
            for item in values[0].split(","):
                spec = _bind_spec(item, cwd)
                if spec and not os.path.exists(spec[0]):
                    raise ConfigError(f"the launch's `{name} {spelled} {item}`: {spec[0]} does not exist here, and "
                                      f"{name} refuses a bind whose source is missing (mount source doesn't exist), "
                                      "so this server never starts; create it first")
                if spec:
                    binds.append(Mount(spec[0], spec[1], f"{spelled} {item}", item.endswith(":ro")))
        elif role == "mountspec":
            fields = dict(p.partition("=")[::2] for p in values[0].split(","))
            src, dst = fields.get("source") or fields.get("src"), fields.get("destination") or fields.get(
                "target") or fields.get("dst")
            if fields.get("type", "bind") == "bind" and src and dst:
                binds.append(Mount(posixpath.normpath(posixpath.join(cwd, src)), posixpath.normpath(dst),
                                   f"{spelled} {values[0]}", "ro" in fields or "readonly" in fields))
        elif role == "bind2":
            src = posixpath.normpath(posixpath.join(cwd, values[0]))
            if not os.path.exists(src) and spelled.endswith("-try"):  # bwrap: the -try forms skip a missing source
                guest.notes.append(f"`{name} {spelled} {values[0]} {values[1]}`: {src} does not exist here, so "
                                   f"{name} skips it")
                continue
            if not os.path.exists(src):
                raise ConfigError(f"the launch's `{name} {spelled} {values[0]} {values[1]}`: {src} does not exist "
                                  f"here, and {name} refuses it (Can't find source path), so this server never "
                                  f"starts; create it first, or use {spelled}-try")
            binds.append(Mount(src, posixpath.normpath(values[1]), f"{spelled} {values[0]} {values[1]}",
                               spelled.startswith("--ro")))
        elif role in ("mask", "mask2"):
            binds.append(Mount(None, posixpath.normpath(values[-1]), f"{spelled} {' '.join(values)}"))
        elif role == "cwd":
            workdir = values[0]
    if name == "bwrap":
        isolated = True
    if name in ("apptainer", "singularity"):
        isolated = True
        image = positional.get("image", "")
        here = posixpath.join(cwd, image)
        if image and os.path.isdir(here):
            root = posixpath.normpath(here)  # a sandbox folder: the image's files are here
        else:
            guest.image_note = (f"the apptainer image {image} is not a folder here, so its files and its environment "
                                "(%environment) were not read")
        roles = {r for r, _, _ in got}
        contain = bool(roles & {"contain", "containall"})
        for var in ("APPTAINER_BIND", "APPTAINER_BINDPATH", "SINGULARITY_BIND", "SINGULARITY_BINDPATH"):
            for item in (guest.get(var, environ) or "").split(","):
                spec = _bind_spec(item.strip(), cwd) if item.strip() else None
                if spec and not os.path.exists(spec[0]):
                    raise ConfigError(f"the launch's {var}={item}: {spec[0]} does not exist here, and {name} refuses "
                                      "a bind whose source is missing (mount source doesn't exist), so this server "
                                      "never starts; create it first")
                if spec:
                    binds.append(Mount(spec[0], spec[1], f"{var}={item}"))
        home_spec = next((v[0] for r, v, _ in got if r == "home"), None)
        home = guest.get("HOME", environ)
        if home_spec is not None:
            spec = _bind_spec(home_spec, cwd)
            if spec:
                binds.append(Mount(spec[0], spec[1], f"--home {home_spec}"))
                guest.set("HOME", spec[1], f"{name} --home {home_spec}")
        elif home and not contain and "nohome" not in roles:
            binds.append(Mount(home, posixpath.normpath(home), f"{name}: the home folder"))
        elif home:
            binds.append(Mount(None, posixpath.normpath(home), f"{name}: a home of its own"))
        if not contain:
            for path in ("/tmp", "/var/tmp"):
                binds.append(Mount(path, path, f"{name}: {path}"))
            binds.append(Mount(cwd, posixpath.normpath(cwd), f"{name}: the current directory"))
        workdir = workdir or (None if contain else cwd)
        prefix = "APPTAINERENV_" if name == "apptainer" else "SINGULARITYENV_"
        for source in ({**environ, **{k: v.value for k, v in guest.env.items()}}, ):
            for key, value in source.items():
                for p in ("APPTAINERENV_", "SINGULARITYENV_"):
                    if key.startswith(p) and (p == prefix or name == "apptainer"):
                        guest.set(key[len(p):], value, f"{key} (apptainer passes it as {key[len(p):]})")
    if name == "chroot" and not any(r == "nochdir" for r, _, _ in got):
        workdir = "/"
    if name == "proot":
        binds = _proot_bindings(binds, root, no_deref)
    if not roots and not binds and not isolated:
        if workdir is not None:
            guest.workdir = workdir if posixpath.isabs(workdir) else posixpath.normpath(
                posixpath.join(guest.workdir or cwd, workdir))
        return
    if inside:
        raise ConfigError(f"the launch's `{shown}` runs inside the container and changes the server's filesystem "
                          f"there, which exl3tool does not follow; {_INSTEAD}")
    if guest.moved:
        raise ConfigError(f"the launch's `{shown}` changes the server's filesystem inside `{guest.moved}`, which "
                          f"exl3tool does not follow (one such wrapper at a time); {_INSTEAD}")
    guest.moved = shown
    if root is None and not isolated:
        root = "/"  # binds over this machine's own tree
    guest.paths = PathMap(tuple(binds), container=True, root=root)
    guest.workdir = workdir if workdir is None or posixpath.isabs(workdir) else None
    where = f"the folder {root}" if root and root != "/" else ("this machine's tree" if root else "an empty root")
    shown_binds = ", ".join(f"{m.host or '(its own)'} at {m.inside}" for m in binds
                            if m.host is None or m.spec.startswith("-"))
    guest.notes.append(f"`{shown}`: the server's filesystem is {where}"
                       + (f", with {shown_binds[:300]}" if shown_binds else "")
                       + "; its paths are read through that view here")


def _proot_bindings(binds: list[Mount], root: Optional[str], no_deref: set[str]) -> list[Mount]:
    """proot's bindings as it installs them (proot-me/proot ``src/path/binding.c``, ``initialize_binding``): each
    guest path canonicalized in the guest (its links read in the root and the bindings that hold it, outer ones
    first; a final ``!`` keeps the last component as written), and of two bindings on one guest path only the last
    is active."""
    from exl3tool.cache.serverfs import server_realpath

    done: list[Mount] = []
    for m in sorted(binds, key=lambda m: m.inside.count("/") if m.inside != "/" else 0):  # outer ones first
        view = PathMap(tuple(done), container=True, root=root or "/")
        inside = m.inside
        if inside != "/":
            head, tail = posixpath.split(inside)
            inside = (posixpath.join(server_realpath(view, head, "proot's binding", unseen="keep"), tail)
                      if inside in no_deref else server_realpath(view, inside, "proot's binding", unseen="keep"))
        done = [d for d in done if d.inside != inside] + [Mount(m.host, inside, m.spec, m.readonly)]
    return done
