"""A launcher script run by the system's bash, read-only: what it would start, with the environment it would start
it with, and nothing started.

The script runs under the real ``bash`` (so functions, ``case``, loops, arrays, subshells, ``$(...)``, ``source``
and defaults behave exactly as they do for the operator), in a throwaway sandbox (docs/launch.md):

* a new user, mount, network and pid namespace (``unshare -Urmnpf``): no network (nothing is downloaded or
  pulled), every mount of this machine remounted read-only, fresh empty ``/tmp``, ``/run``, ``/var/tmp``,
  ``/dev/shm`` (no docker, podman or containerd socket can be reached) and a ``/dev`` holding only ``null``,
  ``zero``, ``full``, ``random``, ``urandom`` and ``tty`` (no GPU); when the sandbox ends every process in it ends;
* ``PATH`` starts with recorders for the commands that start a server, a container, a download or a write
  (``vllm``, ``python``, ``docker``, ``podman``, ``hf``, ``curl``, ``mkdir``, ``rm``, ...): a recorder writes its
  argv, environment and directory into the run's temporary folder and exits 0, running nothing;
* ``exec`` is a shell function (bash looks functions up before builtins): a launcher that ``exec``s another
  launcher script (also by a path of the image, ``/usr/local/bin/serve-*.sh``, found by name beside the first
  script or in ``launcher_dirs``) runs it the same way; any other ``exec`` is recorded, and the script ends there;
* with ``mounts`` (a container's volumes: the script runs inside the image), the script sees a root of its own:
  this machine's system folders read-only (to run bash and its tools), the volumes read-only at their container
  paths, the rest an empty in-memory folder.

The only folder written is the run's own temporary folder, removed afterwards. Without user namespaces the script
is not run (a ConfigError says how to give the launcher's ``DRY_RUN=1`` output instead).
"""

from __future__ import annotations

import os
import posixpath
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

from exl3tool.errors import ConfigError
from exl3tool.launch.env import DRY_RUN_COMMAND, shell_word

__all__ = ["Recorded", "LauncherRun", "LauncherStart", "ScriptView", "run_launcher", "read_launcher",
           "dry_run_command", "sandbox_problem", "script_changes", "HOST_VIEW", "RECORDED_COMMANDS", "SHELLS", "LOOKUP_PREFIXES"]

SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "ash"})
# run nothing, only recorded: servers, interpreters, containers, downloads, GPUs, privileges, writes
RECORDED_COMMANDS = (
    "vllm", "python", "python3", "python3.10", "python3.11", "python3.12", "python3.13", "python3.14", "pip", "pip3",
    "uv", "uvx", "torchrun", "ray", "docker", "podman", "nerdctl", "nvidia-docker", "kubectl", "hf",
    "huggingface-cli", "nvidia-smi", "curl", "wget", "git", "ssh", "scp", "sudo", "su", "nsys", "ncu", "numactl",
    "taskset", "env", "setsid", "nohup", "nice", "ionice", "stdbuf", "timeout", "chrt", "runuser", "gosu", "su-exec", "setpriv", "mkdir", "rm", "rmdir", "cp", "mv", "ln", "touch", "chmod", "chown", "install", "rsync", "truncate",
    "dd", "sleep", "kill", "pkill", "killall", "systemctl", "service", "apt-get", "apt", "yum", "dnf", "conda",
    "mount", "umount", "tmux", "screen", "docker-compose", "podman-compose",
    # wrappers that change the server's filesystem, user or host (launch.wrappers): recorded, never run
    "proot", "proot-distro", "chroot", "bwrap", "unshare", "nsenter", "apptainer", "singularity", "srun", "sbatch",
    "salloc", "mpirun", "mpiexec", "systemd-run", "flatpak-spawn", "firejail", "doas", "pkexec", "schroot",
    "toolbox", "distrobox", "distrobox-enter", "machinectl", "lxc", "lxc-attach", "fakechroot",
)
LOOKUP_PREFIXES = ("VLLM_", "HF_", "XDG_", "HUGGINGFACE_", "TRANSFORMERS_")
_PASS_THROUGH = ("tee",)  # recorded, stdin copied to stdout (no file written)
_DROP = ("BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "PROMPT_COMMAND", "CDPATH", "GLOBIGNORE", "X3T_SANDBOX_RUN",
         "X3T_SANDBOX_LAUNCHER_DIRS", "X3T_SANDBOX_VIEW", "X3T_SANDBOX_UNEXPORTED", "X3T_SANDBOX_SHADOW",
         "X3T_SANDBOX_REAL", "X3T_SANDBOX_MKDIR")
# the system folders where the recorders also stand in for their commands' own files (`/usr/bin/env -i ...`,
# `/usr/bin/ssh HOST ...`, a `#!/usr/bin/env bash` shebang): bash finds a command by PATH, an absolute path does not
_SHADOWED = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
_BASH_OWN = ("SHLVL", "_", "OLDPWD", "PWD")  # set by bash itself, not by the launcher
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")

_RECORDER = r"""#!/bin/sh
# exl3tool: record this command (argv, environment, directory) and run nothing
real() {  # _p: the system's own file of command $1 (the recorders stand in for its name in the system folders)
  _p= _i=$IFS; IFS=:
  for _s in ${X3T_SANDBOX_REAL:-}; do if [ -x "$_s/$1" ]; then _p=$_s/$1; break; fi; done
  IFS=$_i
  [ -n "$_p" ] || _p=$(command -pv "$1")
}
d="$X3T_SANDBOX_RUN/rec/$$"
n="${0##*/}"
if [ "$n" = record ]; then printf '%s\0' "$@" > "$d.argv"; else printf '%s\0' "$n" "$@" > "$d.argv"; fi
real env
"$_p" -0 > "$d.env"
pwd > "$d.cwd"
if [ "$n" = record ]; then n="${1##*/}"; shift; fi
answer=  # a query is answered as a clean host answers it: no container, image, volume or pod exists
case "$n" in
  docker|podman|nerdctl|nvidia-docker)
    obj= verb= skip=
    for a in "$@"; do
      if [ -n "$skip" ]; then skip=; continue; fi
      case "$a" in
        -H|--host|-c|--context|--config|-l|--log-level|--url|--connection|--identity|--root|--runroot|--namespace|\
--storage-driver|--cgroup-manager|--address|--tlscacert|--tlscert|--tlskey) skip=1; continue ;;
        -*) continue ;;
      esac
      if [ -z "$obj" ]; then
        case "$a" in container|image|volume|network|pod|manifest|secret|compose) obj=$a; continue ;; esac
      fi
      verb=$a; break
    done
    case "$verb" in
      inspect|exists|logs|port|top|history|wait|diff|export|healthcheck|mount) answer=absent ;;
      ps|ls|list|images) answer=empty ;;
    esac ;;
  kubectl)
    verb= names=0 skip=
    for a in "$@"; do
      if [ -n "$skip" ]; then skip=; continue; fi
      case "$a" in
        -n|--namespace|-l|--selector|-o|--output|--context|--kubeconfig|-f|--filename|--field-selector|-c|\
--container|--cluster|--user|-L|--label-columns|--sort-by|--template) skip=1; continue ;;
        -*) continue ;;
      esac
      if [ -z "$verb" ]; then verb=$a; else names=$((names + 1)); fi
    done
    case "$verb" in
      get|describe) if [ "$names" -gt 1 ]; then answer=absent; else answer=empty; fi ;;
    esac ;;
esac
if [ -n "$answer" ]; then
  printf '%s' "$answer" > "$d.answer"
  if [ "$answer" = absent ]; then echo "Error: No such object" >&2; exit 1; fi
  exit 0
fi
case "$n" in
  tee) exec cat ;;
  nohup|setsid|nice|ionice|stdbuf|timeout|taskset|numactl|chrt|screen)
    # a wrapper that changes no variable and no path, before a launcher script or make (`nohup ./serve.sh &`,
    # `screen -dmS vllm make serve`): run that command for real, so it is read as any launcher is; before anything
    # else (vllm itself, a container runtime, a tool of the image) the wrapper stays recorded, as it was
    case "$n" in
      nohup) [ "${1:-}" = -- ] && shift ;;
      setsid) while [ $# -gt 0 ]; do case "$1" in -c|-f|-w|--ctty|--fork|--wait) shift ;; --) shift; break ;; *) break ;; esac; done ;;
      nice) case "${1:-}" in -n|--adjustment) shift 2 ;; -n*|--adjustment=*|-[0-9]*) shift ;; esac ;;
      ionice) while [ $# -gt 0 ]; do case "$1" in -c|-n|--class|--classdata) shift 2 ;; -t|--ignore|-c?|-n?) shift ;; *) break ;; esac; done ;;
      stdbuf) while [ $# -gt 0 ]; do case "$1" in -i|-o|-e) shift 2 ;; -i?*|-o?*|-e?*|--input=*|--output=*|--error=*) shift ;; *) break ;; esac; done ;;
      timeout) while [ $# -gt 0 ]; do case "$1" in -s|-k|--signal|--kill-after) shift 2 ;; -*) shift ;; *) break ;; esac; done
               [ $# -gt 0 ] && shift ;;  # the duration
      taskset) case "${1:-}" in -p|--pid) set -- ;; esac
               while [ $# -gt 0 ]; do case "$1" in -a|-c|--all-tasks|--cpu-list) shift ;; *) break ;; esac; done
               [ $# -gt 0 ] && shift ;;  # the mask or CPU list
      numactl) while [ $# -gt 0 ]; do case "$1" in --*=*|-l|--localalloc|-s|--show|-H|--hardware) shift ;;
                 -*) shift 2 ;; *) break ;; esac; done ;;
      chrt) while [ $# -gt 0 ]; do case "$1" in -p|--pid) set -- ; break ;; -T|-P|-D|--sched-runtime|--sched-period|--sched-deadline) shift 2 ;;
              -*) shift ;; *) break ;; esac; done
            [ $# -gt 0 ] && shift ;;  # the priority
      screen) while [ $# -gt 0 ]; do case "$1" in -X|-r|-x|-R|-ls|-list|-wipe|-Q) set -- ; break ;;
                -S|-c|-e|-h|-p|-s|-T|-t|-Logfile|-[dDmRL]*S) shift 2 ;; -*) shift ;; *) break ;; esac; done ;;
    esac
    c=${1:-}
    case "${c##*/}" in
      bash|sh|dash|make|gmake) exec "$@" ;;
      *.sh) if [ -f "$c" ]; then exec "$@"; fi ;;
      "") ;;
      *) if [ -f "$c" ] && [ "$(head -c 2 "$c" 2>/dev/null)" = "#!" ]; then exec "$@"; fi ;;
    esac ;;
  env)  # `env NAME=VALUE ... bash FILE ...` (a launcher handing its inputs to another): run for real, so that script
        # is read as any launcher is, with these variables; any other use of env stays recorded (launch.wrappers).
        # `env bash FILE` and `env -S 'bash -e' FILE` alone are a `#!/usr/bin/env bash` shebang: run, not recorded
    cmd= file= set=
    for a in "$@"; do
      if [ -z "$cmd" ]; then case "$a" in [A-Za-z_]*=*) set=1; continue ;; esac; cmd=$a; continue; fi
      file=$a; break
    done
    shell=${cmd##*/}
    case "$cmd" in -S*) shell=${cmd#-S}; shell=${shell# }; shell=${shell%% *}; shell=${shell##*/} ;; esac
    case "$shell" in
      bash|sh|dash) case "$file" in ""|-*) ;; *) if [ -f "$file" ]; then
        if [ -z "$set" ]; then real rm; "$_p" -f "$d.argv" "$d.env"; fi
        real env
        exec "$_p" "$@"
      fi ;; esac ;;
    esac ;;
  # tried for real, which reaches only this run's memory (/tmp, /var/tmp, /run and a container view are in memory,
  # the rest is read-only): a folder made for a log file is there for the launcher's next command
  mkdir|touch|ln|cp|mv|rm|rmdir|chmod|chown|install|truncate) real "$n"; "$_p" "$@" 2>/dev/null ;;
esac
start= prev=  # the server (or its container) starts: the launcher would wait on it, so the reading ends here
for a in "$n" "$@"; do  # word by word: `vllm serve`, `-m vllm.entrypoints...` (not a word such as vllm_server.sh)
  case "$a" in
    serve) [ "${prev##*/}" = vllm ] && start=1 ;;
    vllm.entrypoints.*) start=1 ;;
  esac
  prev=$a
done
case " $n $* " in *" docker "*" run "*|*" podman "*" run "*|*" nerdctl "*" run "*) start=1 ;; esac
if [ -n "$start" ]; then kill -KILL -1 2>/dev/null; fi
exit 0
"""

# sourced by every bash the sandbox starts (BASH_ENV)
_PRELUDE = r"""# exl3tool: a launcher read without running what it starts (docs/launch.md)
__exl3tool_script() {  # REPLY: the launcher script $1 names (a path of the image: by its name beside the first)
  local p=$1 d IFS=:
  if [[ $p != */* ]]; then p=$(type -P -- "$p") || return 1; fi
  if [[ ! -f $p ]]; then
    local top=${BASH_SOURCE[${#BASH_SOURCE[@]}-1]}  # this shell's script: its folder holds its sibling launchers
    [[ $top == */* ]] || top=./$top
    for d in $X3T_SANDBOX_LAUNCHER_DIRS "${top%/*}"; do
      [[ -n $d && -f $d/${p##*/} ]] && { p=$d/${p##*/}; break; }
    done
  fi
  [[ -f $p ]] || return 1
  local first=
  IFS= read -r first < "$p" || [[ -n $first ]] || return 1
  [[ $first == '#!'*sh* ]] || return 1
  REPLY=$p
}
__exl3tool_unexported() {  # server variables the shell set but did not export: the server does not see them
  local n u=() e=" $(compgen -e | tr '\n' ' ') "
  for n in $(compgen -v); do
    case $n in VLLM_*|HF_*|XDG_*|HUGGINGFACE_*|TRANSFORMERS_*) [[ $e == *" $n "* ]] || u+=("$n") ;; esac
  done
  X3T_SANDBOX_UNEXPORTED="${u[*]}"
}
__exl3tool_record() {
  local X3T_SANDBOX_UNEXPORTED
  __exl3tool_unexported
  X3T_SANDBOX_UNEXPORTED=$X3T_SANDBOX_UNEXPORTED "$X3T_SANDBOX_RUN/record" "$@"
}
for __exl3tool_n in vllm python python3 docker podman nerdctl torchrun; do
  eval "$__exl3tool_n() { __exl3tool_record $__exl3tool_n \"\$@\"; }"
done
unset __exl3tool_n
ulimit() {  # limits a container may raise, this sandbox may not: asked for, taken as given
  builtin ulimit "$@" 2>/dev/null || true
}
exec() {
  while [[ $# -gt 0 && $1 == -* ]]; do
    case $1 in -a) shift ;; --) shift; break ;; esac
    shift
  done
  [[ $# -eq 0 ]] && return 0  # exec with redirections only: nothing replaces the shell
  local REPLY=
  if [[ ! -e $X3T_SANDBOX_RUN/bin/${1##*/} ]] && __exl3tool_script "$1"; then
    shift
    builtin exec bash "$REPLY" "$@"
  fi
  __exl3tool_record "$@"
  builtin exit 0
}
__exl3tool_exit() {  # the environment a launcher exports when it ends (its DRY_RUN=1 mode prints, then exits)
  "$X3T_SANDBOX_RUN/record" __exl3tool_exit__ "${SHLVL:-0}"
}
trap __exl3tool_exit EXIT
if [[ -n ${X3T_SANDBOX_VIEW:-} ]]; then  # inside a container's view: a folder the image has, absent here, is made
  cd() {                             # empty in the view's memory (what is inside the image is not known here)
    builtin cd "$@" 2>/dev/null && return 0
    local d=${!#}
    [[ $# -gt 0 && $d != -* ]] && "${X3T_SANDBOX_MKDIR:-/bin/mkdir}" -p -- "$d" 2>/dev/null
    builtin cd "$@"
  }
fi
command_not_found_handle() {  # a tool of the image that this machine lacks: recorded, taken as succeeding
  "$X3T_SANDBOX_RUN/record" "$@"
  return 0
}
"""

# run as root of the new namespaces: $1 the run's folder, $2 "-" (this host) or a file of "HOST<TAB>TARGET" lines
_SETUP = r"""set -eu
launcher_path=$PATH
PATH=/usr/sbin:/usr/bin:/sbin:/bin
run=$1 view=$2
shift 2
mount --make-rprivate /
exec 3<"$run"
awk '{print $5}' /proc/self/mountinfo | sort -r | while read -r m; do
  m=$(printf '%b' "$m")
  mount -o remount,bind,ro "$m" 2>/dev/null || case "$m" in /proc*|/sys*|/dev*) ;; *) echo "read-only remount of $m failed" >&2; exit 97 ;; esac
done
mount -t tmpfs -o mode=755 exl3tool-scratch "$run/scratch"
exec 4<"$run/scratch"  # kept open: binding $run again below hides this mount (read at the end through fd 4)
for d in /tmp /var/tmp; do  # writable, this machine's files shown, nothing written through (overlay, else read-only)
  if [ -d "$d" ] && [ ! -L "$d" ]; then
    u=$run/scratch/$(echo "$d" | tr / _)
    mkdir -p "$u/up" "$u/work"
    mount -t overlay -o "lowerdir=$d,upperdir=$u/up,workdir=$u/work" exl3tool-overlay "$d" 2>/dev/null || true
  fi
done
for d in /run /dev/shm; do  # empty: no daemon's socket (docker, podman, containerd) can be reached
  if [ -d "$d" ] && [ ! -L "$d" ]; then mount -t tmpfs -o mode=1777 exl3tool-tmp "$d"; fi
done
mount -c --bind /proc/self/fd/3 "$run"
mount -c -o remount,bind,rw "$run"
exec 3<&-
mount -t tmpfs -o mode=755 exl3tool-dev "$run/dev"
for n in null zero full random urandom tty; do
  if [ -e "/dev/$n" ]; then : > "$run/dev/$n"; mount --bind "/dev/$n" "$run/dev/$n"; fi
done
ln -s /proc/self/fd "$run/dev/fd"
ln -s /proc/self/fd/0 "$run/dev/stdin"
ln -s /proc/self/fd/1 "$run/dev/stdout"
ln -s /proc/self/fd/2 "$run/dev/stderr"
mkdir "$run/dev/shm"
mount -t tmpfs -o mode=1777 exl3tool-shm "$run/dev/shm"
mount --rbind "$run/dev" /dev
if (: > /.exl3tool-write-probe) 2>/dev/null || [ -e /dev/nvidia0 ]; then
  echo "the sandbox is not read-only" >&2
  exit 97
fi
shadow() {  # the recorders stand in for their commands' files in the system folders of the root $1 sees, so an
            # absolute path (/usr/bin/env -i ..., /usr/bin/ssh) is recorded as its name on PATH is; the system's own
            # files stay under $run/sys for the recorders (X3T_SANDBOX_REAL) and for the rest of this setup
  real= done=
  for d in $X3T_SANDBOX_SHADOW; do  # first every folder's own files, then the stand-ins (mount is one of them)
    [ -d "$1$d" ] && [ ! -L "$1$d" ] || continue
    mount --bind "$1$d" "$1$run/sys$d" 2>/dev/null || continue
    real=${real:+$real:}$run/sys$d done="$done $d"
  done
  mnt=$(command -v mount) mk=/bin/mkdir
  for d in $(echo "$real" | tr : ' '); do
    if [ -x "$d/mount" ] && [ "$mnt" = "$(command -v mount)" ]; then mnt=$d/mount; fi
    if [ -x "$d/mkdir" ] && [ "$mk" = /bin/mkdir ]; then mk=$d/mkdir; fi
  done
  for d in $done; do
    if ! "$mnt" -t overlay -o "lowerdir=$run/shadow:$1$d" exl3tool-shadow "$1$d" 2>/dev/null; then
      for f in "$run"/shadow/*; do  # no overlay here: over each file the folder has
        if [ -f "$1$d/${f##*/}" ]; then "$mnt" --bind "$run/record" "$1$d/${f##*/}" 2>/dev/null || true; fi
      done
    fi
  done
  export X3T_SANDBOX_REAL="$real" X3T_SANDBOX_MKDIR="$mk"
}
if [ "$view" != - ]; then
  root=$run/root
  mkdir "$root"
  mount -t tmpfs -o mode=755 exl3tool-root "$root"
  for d in /usr /bin /sbin /lib /lib32 /lib64 /libx32 /etc; do
    if [ -L "$d" ]; then ln -s "$(readlink "$d")" "$root$d"
    elif [ -d "$d" ]; then mkdir -p "$root$d"; mount --rbind "$d" "$root$d"; fi
  done
  for d in /tmp /dev /proc; do mkdir -p "$root$d"; done
  chmod 1777 "$root/tmp"
  mount --rbind /dev "$root/dev"
  mount --rbind /proc "$root/proc"
  while IFS='	' read -r host target; do
    [ -n "$target" ] || continue
    if [ -d "$host" ]; then mkdir -p "$root$target"; else mkdir -p "$root${target%/*}"; : > "$root$target"; fi
    mount --rbind "$host" "$root$target"
    mount -o remount,bind,ro "$root$target"
  done < "$view"
  mkdir -p "$root$run"
  mount --rbind "$run" "$root$run"
  chroot=$(command -v chroot)
  shadow "$root"
  export PATH="$launcher_path"
  "$chroot" "$root" "$@" 4<&- && status=0 || status=$?
else
  shadow ""
  export PATH="$launcher_path"
  "$@" 4<&- && status=0 || status=$?  # not exec'd: as init of the namespace this shell outlives a recorder's kill -1
fi
PATH=${X3T_SANDBOX_REAL:+$X3T_SANDBOX_REAL:}/usr/sbin:/usr/bin:/sbin:/bin  # the system's own sleep, not a recorder
i=0  # what the launcher left running in the background (a server started with &): a few seconds to be recorded
while [ $i -lt 60 ]; do
  set -- /proc/[0-9]*
  [ $# -gt 1 ] || break
  sleep 0.05
  i=$((i + 1))
done
{  # the files the launcher wrote in the sandbox's memory (the /tmp overlays, a container view's own root)
  for d in /tmp /var/tmp; do
    u=/proc/$$/fd/4/$(echo "$d" | tr / _)/up  # folders are read through the descriptor kept above
    if [ -d "$u" ]; then (cd "$u" && find . -type f) | sed "s|^\\.|$d|"; fi
  done
  if [ -n "${root:-}" ]; then (cd "$root" && find . -xdev -type f) | sed "s|^\\.||"; fi
} 2>/dev/null | head -n 5000 > "$run/written" || true
exit $status
"""


@dataclass(frozen=True)
class Recorded:
    """One command the launcher would have run: its words, environment and directory, in the order started."""

    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    at_exit: bool = False  # not a command: the environment a bash process exported when it ended
    level: int = 0  # at_exit: that shell's nesting (SHLVL)
    unexported: tuple[str, ...] = ()  # server variables (VLLM_*, HF_*, XDG_*) the shell set without exporting them
    answer: str = ""  # a query of a container runtime, answered as a clean host: "absent" (exit 1) | "empty" (none)


@dataclass(frozen=True)
class ScriptView:
    """Where a script the launch runs is read: this host (``mounts`` None) or a container's view (its volumes as
    (host folder, container path) pairs), the folders where a launcher named by another machine's path is looked up
    by its name, and the directory it starts in (None: this directory, or ``/`` in a container's view)."""

    mounts: Optional[tuple[tuple[str, str], ...]] = None
    launcher_dirs: tuple[str, ...] = ()
    cwd: Optional[str] = None

    def read(self, argv: Sequence[str], *, environ: Mapping[str, str], is_server,
             where: str) -> Optional["LauncherStart"]:
        """``read_launcher`` in this view."""
        return read_launcher(argv, environ=environ, is_server=is_server, cwd=self.cwd,
                             launcher_dirs=self.launcher_dirs, mounts=self.mounts, where=where)


HOST_VIEW = ScriptView()


@dataclass
class LauncherRun:
    """What the launcher did in the sandbox: the commands recorded, its output and exit status."""

    records: list[Recorded]
    stdout: str
    stderr: str
    status: int
    notes: list[str] = field(default_factory=list)
    written: tuple[str, ...] = ()  # files it wrote in the sandbox's memory (paths as it saw them)


_problem: Optional[str] = None


def _tool(name: str) -> Optional[str]:
    """The system's ``name`` (bash, unshare): on PATH, else in the system's folders."""
    return shutil.which(name) or shutil.which(name, path=_DEFAULT_PATH)


def sandbox_problem() -> str:
    """Why a launcher cannot be run in the sandbox on this machine ("" when it can): no bash, no unshare, or user
    namespaces refused (a container without them, ``kernel.unprivileged_userns_clone=0``)."""
    global _problem
    if _problem is None:
        if _tool("bash") is None or _tool("unshare") is None:
            _problem = "bash and unshare (util-linux) are needed to run a launcher read-only"
        else:
            try:
                done = subprocess.run([_tool("unshare") or "unshare", "-Urmn", "true"], capture_output=True, text=True,
                                      timeout=20)
                _problem = "" if done.returncode == 0 else (
                    f"user namespaces are not allowed here (unshare -Urmn: {done.stderr.strip() or done.returncode})")
            except (OSError, subprocess.TimeoutExpired) as exc:
                _problem = f"unshare -Urmn failed ({exc})"
    return _problem


def _clean(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in _DROP and not k.startswith("BASH_FUNC_")}


def _read_records(run: str, path_given: Optional[str]) -> list[Recorded]:
    rec = os.path.join(run, "rec")
    out: list[tuple[int, Recorded]] = []
    for name in os.listdir(rec):
        if not name.endswith(".argv"):
            continue
        stem = os.path.join(rec, name[:-5])
        try:
            with open(stem + ".argv", "rb") as fh:
                argv = fh.read().split(b"\0")[:-1]
            with open(stem + ".env", "rb") as fh:
                pairs = fh.read().split(b"\0")[:-1]
            with open(stem + ".cwd", encoding="utf-8", errors="surrogateescape") as fh:
                cwd = fh.read().rstrip("\n")
        except OSError:
            continue  # a recorder killed half-way (the time limit)
        try:
            with open(stem + ".answer", encoding="utf-8") as fh:
                answer = fh.read().strip()
        except OSError:
            answer = ""
        env: dict[str, str] = {}
        for pair in pairs:
            k, _, v = pair.decode("utf-8", "surrogateescape").partition("=")
            env[k] = v
        unexported = tuple(env.get("X3T_SANDBOX_UNEXPORTED", "").split())
        env = {k: v for k, v in _clean(env).items() if k not in _BASH_OWN}
        if path_given is None:
            env.pop("PATH", None)
        elif "PATH" in env:
            env["PATH"] = path_given if env["PATH"].startswith(os.path.join(run, "bin")) else env["PATH"]
        words = tuple(a.decode("utf-8", "surrogateescape") for a in argv)
        at_exit = words[:1] == ("__exl3tool_exit__",)
        level = int(words[1]) if at_exit and len(words) > 1 and words[1].isdigit() else 0
        out.append((int(name[:-5]), Recorded(() if at_exit else words, env, cwd, at_exit, level, unexported, answer)))
    return [r for _, r in sorted(out, key=lambda t: t[0])]


def run_launcher(argv: Sequence[str], *, environ: Mapping[str, str], cwd: Optional[str] = None,
                 launcher_dirs: Sequence[str] = (), mounts: Optional[Sequence[tuple[str, str]]] = None,
                 timeout: float = 30.0, stdin: str = "") -> LauncherRun:
    """Run ``argv`` (``["bash", "-c", TEXT]``, ``["bash", FILE, ARGS...]``) in the sandbox with ``environ``.

    Args:
        environ: the environment the launcher starts with (the operator's shell, or a container's ``ENV``).
        cwd: where it starts (this host's folder; in a container view, a path of the container).
        launcher_dirs: folders where a script named by a path of another machine is looked up by its name.
        mounts: (host folder, container path) pairs: run inside a container's view (see the module's doc).

    Raises:
        ConfigError: the sandbox is not available, or the launcher ran past ``timeout``.
    """
    problem = sandbox_problem()
    if problem:
        raise ConfigError(f"cannot read a launcher script here: {problem}; run it with DRY_RUN=1 where it is "
                          "deployed and give its output instead (--launch-file dryrun.txt, docs/launch.md)")
    run = tempfile.mkdtemp(prefix="exl3tool-launch-")
    try:
        bindir = os.path.join(run, "bin")
        os.makedirs(bindir)
        os.makedirs(os.path.join(run, "rec"))
        os.makedirs(os.path.join(run, "scratch"))
        os.makedirs(os.path.join(run, "dev"))
        os.makedirs(os.path.join(run, "shadow"))
        shadowed = [d for d in _SHADOWED if os.path.isdir(d) and not os.path.islink(d)]
        for d in shadowed:
            os.makedirs(os.path.join(run, "sys" + d))
        recorder = os.path.join(run, "record")
        with open(recorder, "w", encoding="utf-8") as fh:
            fh.write(_RECORDER)
        os.chmod(recorder, 0o755)
        for name in (*RECORDED_COMMANDS, *_PASS_THROUGH):
            os.symlink(recorder, os.path.join(bindir, name))
            os.symlink(recorder, os.path.join(run, "shadow", name))
        bash = _tool("bash")
        assert bash is not None  # sandbox_problem() said so
        os.symlink(bash, os.path.join(bindir, "bash"))
        prelude = os.path.join(run, "prelude.sh")
        with open(prelude, "w", encoding="utf-8") as fh:
            fh.write(_PRELUDE)
        setup = os.path.join(run, "setup.sh")
        with open(setup, "w", encoding="utf-8") as fh:
            fh.write(_SETUP)
        view = "-"
        if mounts is not None:
            view = os.path.join(run, "mounts.tsv")
            with open(view, "w", encoding="utf-8") as fh:
                for host, target in sorted(mounts, key=lambda m: m[1]):
                    if os.path.exists(host) and "\t" not in host + target and "\n" not in host + target:
                        fh.write(f"{host}\t{target}\n")
                for d in launcher_dirs:
                    if os.path.isdir(d):
                        fh.write(f"{d}\t{d}\n")
        path_given = environ.get("PATH")
        env = _clean(environ)
        env.update(PATH=f"{bindir}:{path_given or _DEFAULT_PATH}", BASH_ENV=prelude, X3T_SANDBOX_RUN=run,
                   X3T_SANDBOX_LAUNCHER_DIRS=":".join(launcher_dirs), X3T_SANDBOX_SHADOW=" ".join(shadowed))
        if mounts is not None:
            env["X3T_SANDBOX_VIEW"] = "1"
        where = cwd or ("/" if mounts is not None else os.getcwd())
        inner = ["/bin/sh", "-c", 'cd "$1" 2>/dev/null || { [ -n "${X3T_SANDBOX_VIEW:-}" ] && "$X3T_SANDBOX_MKDIR" -p "$1" && cd "$1"; } '
                 '|| cd /; shift; exec "$@"', "cd", where, *argv]
        command = [_tool("unshare") or "unshare", "-Urmnpf", "--kill-child", "--mount-proc", "/bin/sh", setup, run, view, *inner]
        try:
            done = subprocess.run(command, env=env, input=stdin, capture_output=True, text=True, timeout=timeout,
                                  errors="replace", cwd="/")
        except subprocess.TimeoutExpired:
            raise ConfigError(f"the launcher ran for more than {timeout:.0f} s in the read-only sandbox and was "
                              "stopped (is it waiting for something?)") from None
        if done.returncode == 97:
            raise ConfigError(f"cannot read a launcher script here: {done.stderr.strip()}")
        try:
            with open(os.path.join(run, "written"), encoding="utf-8", errors="replace") as fh:
                written = tuple(line.rstrip("\n") for line in fh if line.strip())
        except OSError:
            written = ()
        return LauncherRun(_read_records(run, path_given), done.stdout, done.stderr, done.returncode,
                           written=written)
    finally:
        shutil.rmtree(run, ignore_errors=True)


@dataclass(frozen=True)
class LauncherStart:
    """The server's start a launcher makes: its command, its environment and directory, and how it was found."""

    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    how: str  # "exec" (the command it starts, recorded) | "DRY_RUN=1" (its dry run's Command: line)
    notes: tuple[str, ...] = ()
    unexported: tuple[str, ...] = ()  # server variables the launcher set without exporting them


def dry_run_command(stdout: str) -> Optional[list[str]]:
    """The words of the last ``Command: ...`` line a launcher's ``DRY_RUN=1`` printed (``printf ' %q'``), or None."""
    lines = [line for line in stdout.splitlines() if line.startswith(DRY_RUN_COMMAND)]
    if not lines:
        return None
    try:
        words = shell_word(lines[-1][len(DRY_RUN_COMMAND):])
    except ValueError:
        return None
    return words or None


def _others(run: LauncherRun, server: Optional[Recorded]) -> tuple[str, ...]:
    """Notes: what the launcher also ran (recorded, not run), and the runtime queries a stand-in answered."""
    ran = [shlex.join(r.argv[:2]) for r in run.records if not r.at_exit and r is not server and not r.answer]
    notes: list[str] = []
    if ran:
        shown = "; ".join(dict.fromkeys(ran))
        notes.append(f"the launcher also ran, recorded but not run: {shown[:400]}")
    asked = [f"`{shlex.join(r.argv[:6])}` (answered {'no' if r.answer == 'absent' else 'none'})"
             for r in run.records if r.answer]
    if asked:
        notes.append(f"the launcher asked {', '.join(dict.fromkeys(asked))[:400]}: the read-only sandbox has no "
                     "containers, images or pods, so it went on as on a clean host")
    return tuple(notes)


def script_changes(start: LauncherStart, environ: Mapping[str, str], where: str) -> tuple[
        dict[str, tuple[str, str]], list[str]]:
    """What the script exported for the server that ``environ`` did not hold (name -> (value, where)), and notes
    for look-up variables it removed or set without exporting."""
    how = f"set by {where} (run by bash{', its DRY_RUN=1 mode' if start.how == 'DRY_RUN=1' else ''})"
    exports = {k: (v, how) for k, v in start.env.items() if environ.get(k) != v and k != "PATH"}
    notes = [f"{where} unsets {k}: the server does not get it" for k in environ
             if k not in start.env and k.startswith(LOOKUP_PREFIXES)]
    notes += [f"{where} sets {k} but does not export it: the server does not see it" for k in start.unexported]
    return exports, notes


# bash's line for a write the read-only sandbox refused (`cat > config.yaml <<EOF`, `vllm serve ... > logs/x.log`)
_UNWRITTEN = re.compile(r"^(?:.*?: )?(?:line \d+: )?(?P<path>[^:]+): Read-only file system$")


def _unwritten(run: LauncherRun) -> list[tuple[str, str]]:
    """The files the launcher tried to write where the sandbox is read-only: (path as written, bash's line)."""
    return [(m.group("path"), line.strip()) for line in run.stderr.splitlines()
            if (m := _UNWRITTEN.match(line.strip())) and " " not in m.group("path")]


# options whose value is a file or folder exl3tool reads as the server's: --config, env files, volume sources
_FILE_OPTIONS = ("--config", "--env-file", "-v", "--volume", "--mount", "-B", "--bind")


def _named_files(argv: Sequence[str]) -> list[tuple[str, str]]:
    """(path, as written) for each file or folder a file-bearing option of ``argv`` names."""
    out: list[tuple[str, str]] = []
    for i, word in enumerate(argv):
        name, eq, value = word.partition("=")
        if eq and name in _FILE_OPTIONS:
            shown = word
        elif word in _FILE_OPTIONS and i + 1 < len(argv):
            value, shown = argv[i + 1], f"{word} {argv[i + 1]}"
        else:
            continue
        if name in ("--mount",) or "source=" in value or "src=" in value:
            fields = dict(f.partition("=")[::2] for f in value.split(","))
            value = fields.get("source") or fields.get("src") or ""
        elif name in ("-v", "--volume", "-B", "--bind") or word in ("-v", "--volume", "-B", "--bind"):
            value = value.split(":", 1)[0]
        if value:
            out.append((value, shown))
    return out


def _names_unwritten(run: LauncherRun, server: Recorded, where: str) -> None:
    """Refuse a server whose command reads (``--config``, an env file, a volume) a file its launcher wrote just
    before (a here-document): the sandbox kept that write in its memory, or refused it (read-only), so the file read
    here (absent, or an older copy) is not the one the server reads."""
    cwd = server.cwd or "/"
    failed = {posixpath.normpath(posixpath.join(cwd, p)): f"the read-only sandbox refused it: {line}"
              for p, line in _unwritten(run)}
    failed.update({posixpath.normpath(p): "the sandbox kept it in memory" for p in run.written})
    if not failed:
        return
    for value, shown in _named_files(server.argv[1:]):
        target = posixpath.normpath(posixpath.join(cwd, value))
        hit = next((f for f in failed if f == target or f.startswith(target.rstrip("/") + "/")), None)
        if hit is not None:
            raise ConfigError(
                f"{where} writes {hit} before it starts the server, whose command reads it ({shown}); "
                f"{failed[hit]}, so what exl3tool would read here is not what the server reads: give the launch "
                "with that file already written (the command alone, --launch), or the launcher's DRY_RUN output")


def _no_server_unwritten(run: LauncherRun, where: str) -> Optional[ConfigError]:
    """No server recorded, and the launcher's writes were refused: a command whose redirection fails does not run
    (`nohup vllm serve ... > logs/server.log 2>&1 &`), so say that rather than 'no server'."""
    failed = _unwritten(run)
    if not failed:
        return None
    shown = "; ".join(dict.fromkeys(line for _, line in failed))[:300]
    return ConfigError(f"{where} started no server in the read-only sandbox, where its writes failed ({shown}): a "
                       "command whose output is redirected to such a file is not run there (`vllm serve ... > "
                       "logs/server.log`); give the server's command without the redirection (--launch), or the "
                       "launcher's DRY_RUN output")


def read_launcher(argv: Sequence[str], *, environ: Mapping[str, str], is_server, cwd: Optional[str] = None,
                  launcher_dirs: Sequence[str] = (), mounts: Optional[Sequence[tuple[str, str]]] = None,
                  where: str = "the launcher",
                  refused: Optional[Callable[[list[str]], Optional[str]]] = None) -> Optional[LauncherStart]:
    """The server a launcher starts (``is_server(argv, cwd)`` says which recorded command, run in ``cwd``, is
    one), or None when it
    ends well without starting one (a ConfigError with its last error line when it fails). First run as written;
    when it records no server, its ``DRY_RUN=1`` mode (the fork's launchers print ``KEY=%q`` lines and ``Command:
    ...``, skipping their GPU probes), taking the environment it exported. ``refused(argv)`` names a recorded
    command that runs the server where exl3tool does not follow (``ssh HOST '...'``): raised when no server was
    found, instead of "no server"."""
    first = run_launcher(argv, environ=environ, cwd=cwd, launcher_dirs=launcher_dirs, mounts=mounts)
    servers = [r for r in first.records if not r.at_exit and is_server(list(r.argv), r.cwd)]
    if servers:
        r = servers[-1]
        _names_unwritten(first, r, where)
        return LauncherStart(r.argv, r.env, r.cwd, "exec", _others(first, r), r.unexported)
    runs = [first]
    if "DRY_RUN" not in environ or DRY_RUN_COMMAND not in first.stdout:
        runs.append(run_launcher(argv, environ={**environ, "DRY_RUN": "1"}, cwd=cwd, launcher_dirs=launcher_dirs,
                                 mounts=mounts))
        servers = [r for r in runs[-1].records if not r.at_exit and is_server(list(r.argv), r.cwd)]
        if servers:
            r = servers[-1]
            _names_unwritten(runs[-1], r, where)
            return LauncherStart(r.argv, {k: v for k, v in r.env.items() if k != "DRY_RUN"}, r.cwd, "exec",
                                 _others(runs[-1], r), r.unexported)
    for run, added in zip(runs, (False, True)):
        words = dry_run_command(run.stdout)
        exits = [r for r in run.records if r.at_exit]
        if not exits:
            continue
        deepest = max(exits, key=lambda r: r.level)  # the launcher itself, not the shell that started it
        if words is None or not is_server(words, deepest.cwd):
            continue
        env = {k: v for k, v in deepest.env.items() if not (added and k == "DRY_RUN")}
        why = ""
        if added:
            said = (first.stderr.strip().splitlines() or [f"exit {first.status}"])[-1]
            why = (f"{where} started no server when run as written ({said[:160]}), so its DRY_RUN=1 mode was read: "
                   "the server's command from its Command: line, the environment it exported")
        notes = ((why,) if why else ()) + _others(run, None)
        return LauncherStart(tuple(words), env, deepest.cwd, "DRY_RUN=1", notes)
    for run in runs:
        for r in run.records:
            said = refused(list(r.argv)) if refused is not None and not r.at_exit else None
            if said:
                raise ConfigError(said)
    unwritten = _no_server_unwritten(first, where)
    if unwritten is not None:
        raise unwritten
    if first.status != 0:
        said = (first.stderr.strip().splitlines() or ["(it printed nothing)"])[-1]
        asked = [shlex.join(r.argv[:6]) for r in first.records if r.answer == "absent"]
        why = (f" (before that it asked `{'`, `'.join(dict.fromkeys(asked))}`, answered no: the read-only sandbox "
               "has no containers or images)" if asked else "")
        raise ConfigError(f"{where} exited {first.status} in the read-only sandbox before starting a server: "
                          f"{said[:240]}{why[:300]}")
    return None
