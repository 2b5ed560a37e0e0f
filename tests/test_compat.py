"""fedmed.core.compat: the runtime work-arounds fedmed's FLARE processes install."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RACE = """
import ast, gc, io, sys, threading
import numpy as np
sys.path.insert(0, {root!r})
if {serialize}:
    from fedmed.core.compat import serialize_ast_parse
    serialize_ast_parse(); serialize_ast_parse()  # idempotent: one lock, not two wrappers
    assert ast.parse.__wrapped__.__module__ == "ast"
gc.set_threshold(50, 1, 1)  # frequent collections of cycles whose finalizers run Python code (a thread switch)

class Cyclic:
    def __del__(self):
        x = 0
        for i in range(50):
            x += i

buf = io.BytesIO(); np.save(buf, np.zeros((3, 4), np.float32)); raw = buf.getvalue()
errors = []

def decode():  # what FLARE's download threads do with every array they receive
    for _ in range(3000):
        a, b = Cyclic(), Cyclic(); a.o, b.o = b, a
        try:
            np.load(io.BytesIO(raw))
            ast.literal_eval("{{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }}")
        except SystemError as e:
            errors.append(str(e))

threads = [threading.Thread(target=decode) for _ in range(8)]
[t.start() for t in threads]; [t.join() for t in threads]
print(len(errors), errors[:1])
"""


def test_arrays_decoded_in_many_threads_at_once_never_fail_once_ast_parse_is_serialized():
    """np.load in 8 threads under cyclic-GC finalizers — FLARE's server taking several sites' arrays at once — hits
    CPython 3.11's shared AST recursion counter ("AST constructor recursion depth mismatch") a few times per 24,000
    loads without the lock (this machine, Python 3.11.7); with fedmed.core.compat's lock: never."""
    out = subprocess.run([sys.executable, "-c", RACE.format(root=str(ROOT), serialize=True)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0] == "0", out.stdout


def test_fedmeds_flare_processes_serialize_ast_parse():
    """The server's controller and the sites' executor (fedmed_flare, installed with fedmed) install the lock when
    FLARE imports them, in every environment (simulator, POC, provisioned)."""
    code = ("import ast, sys; sys.path.insert(0, '.')\n"
            "before = getattr(ast.parse, '_fedmed_serialized', False)\n"
            "import {module}\n"
            "print(before, getattr(ast.parse, '_fedmed_serialized', False))")
    for module in ("fedmed_flare.controller", "fedmed_flare.executor"):
        out = subprocess.run([sys.executable, "-c", code.format(module=module)], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
        assert out.stdout.split() == ["False", "True"], (module, out.stdout, out.stderr[-1500:])
