"""The server's launch as an input: its command line, container start or running process, read into the settings
of every look-up it makes, each with where it came from.

``load_launch`` reads a launch (``load``: one reader per form; ``script``: shell scripts run by bash in a read-only
sandbox; ``parse``: where the server starts and the fork's flags; ``wrappers``: proot, env -i, sudo -u ... followed
or refused; ``container``: docker/podman run; ``image``: an image's ENV and entrypoint; ``compose``: a docker
compose service; ``proc``: ``/proc/PID``; ``env``: env files and precedence); ``resolve_launch`` turns it into
``LaunchSettings``;
``apply_launch`` fills a ``ServerRequest`` from them, so ``identity``, ``encode``, ``cache warm``, ``verify`` (and
every command that builds a request) take a launch the same way.
"""

from exl3tool.launch.env import EnvLayers, EnvValue, read_env_file
from exl3tool.launch.load import launch_from_words, load_launch
from exl3tool.launch.request import LaunchInput, apply_launch
from exl3tool.launch.resolve import Explicit, LaunchSettings, ServerLaunch, Setting, resolve_launch

__all__ = ["EnvLayers", "EnvValue", "read_env_file", "launch_from_words", "load_launch", "LaunchInput",
           "apply_launch", "Explicit", "LaunchSettings", "ServerLaunch", "Setting", "resolve_launch"]
