"""alignloop's stage libraries and stages.

A process the CLI started (a stage, its workers) ends quietly with 130 on SIGINT: Ctrl-C
reaches the terminal's whole process group, the CLI says the one line, and a stage interrupted
while it still imports must not print a traceback. Installed here, before any stage module's
imports run; the CLI process itself keeps its own handler (flows/signals.py).
"""
import os as _os
import signal as _signal

if _os.environ.get("ALIGNLOOP_CLI_PID") not in (None, str(_os.getpid())):
    _signal.signal(_signal.SIGINT, lambda *_: _os._exit(128 + _signal.SIGINT))
