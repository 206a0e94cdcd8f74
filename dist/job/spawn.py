"""Child processes started by module name, the same way on every supported Python.

`python -m MODULE` puts the working folder first on sys.path, so a user's folder holding a file named
like one of ours (engine.py, dist/, numpy.py) would shadow the installed package inside every rank.
The bootstrap below removes that entry before the module is imported (Python >= 3.11 has `-P` for this;
3.9 and 3.10 do not).
"""
import sys

_BOOTSTRAP = ("import sys, runpy\n"
              "if sys.path and sys.path[0] == '':\n"
              "    del sys.path[0]\n"
              "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)\n")


def module_command(module, *args):
    """argv that runs MODULE as __main__ with ARGS in a fresh interpreter, without the working folder
    on its sys.path."""
    return [sys.executable, "-c", _BOOTSTRAP, module, *map(str, args)]
