#!/usr/bin/env python
"""Run TorchShard's own test suite against TorchShard and against autoshard (`import autoshard as ts`).

Usage:

    python benchmarks/torchshard_suite.py PATH/TO/torchshard-checkout [--repeat N] [--only autoshard]

TorchShard 0.1.0's tests (its `tests/` folder: 17 tests in 5 files) need 2 CUDA GPUs and NCCL.
This script copies them from the checkout into a temporary folder and ports them with mechanical
edits only, then runs every file with unittest, once with TorchShard and once with autoshard:

- `testing.py`: backend NCCL -> gloo; the fixed rendezvous port 23456 -> a free port (each run has
  its own, so parallel runs do not collide); `Tensor.cuda`, `Module.cuda` and
  `torch.cuda.synchronize` patched to no-ops at its top; `barf()` (a pdb breakpoint, reached when
  `assertEqual` finds a difference above the threshold) raises AssertionError instead;
- every test file: `torch.cuda.device_count()` -> 2 (ranks), the `skipIf(not cuda)` decorators
  removed, DDP's `device_ids=[local_rank]` -> `device_ids=None` (CPU modules);
- the autoshard copy only: `import torchshard as ts` -> `import autoshard as ts`. No shim.

Nothing else is changed: thresholds (1e-6), seeds, models and assertions are TorchShard's.
TorchShard is installed from the checkout into the temporary folder (`pip install --no-deps
--target`); if that fails the checkout itself is put on PYTHONPATH. autoshard is this repository.
TorchShard's code is read from the checkout at run time; none of it is part of this repository.

Prints one row per test (pass / fail with the largest reported difference or the error) and
the counts; `--repeat N` runs everything N times and counts passes per test (some tests are
close to their tolerance or race at exit, so one run can be luck). `--json PATH` writes the
records. Runtime: about 2 to 4 minutes per library and repeat on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.common import free_port  # noqa: E402

RANKS = 2

# (file pattern, old, new, required): `required` edits must match at least once, so a changed
# upstream file fails loudly instead of running unported.
PRELUDE = ("import os\nimport torch\n"
           "torch.Tensor.cuda = lambda self, *args, **kwargs: self          # ported: CPU only\n"
           "torch.nn.Module.cuda = lambda self, *args, **kwargs: self\n"
           "torch.cuda.synchronize = lambda *args, **kwargs: None\n")
EDITS = [
    ("testing.py", "backend='NCCL'", "backend='gloo'", True),
    ("testing.py", "init_method='tcp://127.0.0.1:23456'",
     "init_method='tcp://127.0.0.1:' + os.environ['TS_SUITE_PORT']", True),
    ("testing.py", "    import pdb\n    pdb.set_trace()",
     "    raise AssertionError('assertEqual: difference above the threshold (see diff value above)')", True),
    ("test_*.py", "torch.cuda.device_count()", str(RANKS), True),
    ("test_*.py", "    @unittest.skipIf(not torch.cuda.is_available(), 'CUDA is not available')\n", "", True),
    ("test_*.py", "device_ids=[local_rank]", "device_ids=None", False),
]
SWAP = ("import torchshard as ts", "import autoshard as ts")

DRIVER = r'''
"""Run one ported test module; append one JSON line per test to argv[2]."""
import json, os, re, sys, time, unittest


def log_size():
    sys.stdout.flush(); sys.stderr.flush()
    return os.path.getsize(log_path)


class Result(unittest.TextTestResult):
    def startTest(self, test):
        self._t0, self._log0 = time.time(), log_size()
        super().startTest(test)

    def _record(self, test, status, err=None):
        with open(log_path, errors="replace") as f:
            f.seek(self._log0)
            log = f.read()
        diffs = [float(v) for v in re.findall(r"diff value = ([0-9.eE+-]+)", log)]
        detail = self._exc_info_to_string(err, test) if err is not None else ""
        rec = {"test": test.id(), "status": status, "seconds": round(time.time() - self._t0, 1),
               "max_diff": max(diffs) if diffs else None, "detail": detail[-3000:]}
        with open(out_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def addSuccess(self, test):
        super().addSuccess(test); self._record(test, "pass")

    def addFailure(self, test, err):
        super().addFailure(test, err); self._record(test, "fail", err)

    def addError(self, test, err):
        super().addError(test, err); self._record(test, "error", err)

    def addSkip(self, test, reason):
        super().addSkip(test, reason); self._record(test, "skip")


def flat(suite):
    for t in suite:
        yield from (flat(t) if isinstance(t, unittest.TestSuite) else [t])


if __name__ == "__main__":                 # spawned ranks import this module again
    module, out_path, log_path = sys.argv[1], sys.argv[2], sys.argv[3]
    suite = unittest.defaultTestLoader.loadTestsFromName(module)
    with open(out_path + ".ids", "w") as f:
        f.write("\n".join(t.id() for t in flat(suite)) + "\n")
    unittest.TextTestRunner(verbosity=2, resultclass=Result, stream=sys.stderr).run(suite)
'''


def port_tests(checkout: Path, dest: Path, library: str) -> list[str]:
    """Copy the checkout's tests/ into `dest` with the edits; returns the test module names."""
    src = checkout / "tests"
    files = sorted(p for p in src.glob("*.py"))
    if not (src / "testing.py").exists() or not any(p.name.startswith("test_") for p in files):
        raise SystemExit(f"{src} does not look like TorchShard's tests/ (no testing.py / test_*.py)")
    dest.mkdir(parents=True)
    used = defaultdict(int)
    for path in files:
        text = path.read_text()
        if path.name == "testing.py":
            text = PRELUDE + text
        for pattern, old, new, _ in EDITS:
            if Path(path.name).match(pattern) and old in text:
                used[(pattern, old)] += text.count(old)
                text = text.replace(old, new)
        if library == "autoshard":
            if SWAP[0] not in text:
                raise SystemExit(f"{path.name}: no {SWAP[0]!r} to swap")
            text = text.replace(SWAP[0], SWAP[1])
        (dest / path.name).write_text(text)
    missing = [old for pattern, old, _, required in EDITS if required and not used[(pattern, old)]]
    if missing:
        raise SystemExit(f"port: these edits found nothing to change (upstream changed?): {missing}")
    (dest / "_driver.py").write_text(DRIVER)
    return [p.stem for p in files if p.name.startswith("test_")]


def install_torchshard(checkout: Path, tmp: Path) -> tuple[Path, str]:
    """Install TorchShard from a copy of the checkout into tmp/site; (path for PYTHONPATH, how)."""
    copy = tmp / "torchshard-src"
    shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".git", ".github", "projects", "docs"))
    site = tmp / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
           "--target", str(site), str(copy)]
    env = dict(os.environ, PYTHONPATH=str(copy))              # its setup.py imports torchshard
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode == 0 and (site / "torchshard" / "__init__.py").exists():
        return site, "pip install --no-deps --target (temporary)"
    print(f"pip install of TorchShard failed ({proc.stderr.strip()[-300:]}); using the checkout on PYTHONPATH")
    return copy, "checkout on PYTHONPATH"


def run_library(library: str, tests_dir: Path, modules: list[str], pythonpath: list[Path],
                timeout: float) -> list[dict]:
    """Run every ported module of one library in its own process; one record per test."""
    records = []
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tests_dir)] + [str(p) for p in pythonpath])
    env["PYTHONWARNINGS"] = "ignore"
    for module in modules:
        out, log = tests_dir / f"{module}.jsonl", tests_dir / f"{module}.log"
        out.unlink(missing_ok=True)
        env["TS_SUITE_PORT"] = str(free_port())
        t0 = time.time()
        with open(log, "w") as logf:
            try:
                subprocess.run([sys.executable, "_driver.py", module, str(out), str(log)], cwd=tests_dir,
                               env=env, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
        done = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        ids = Path(str(out) + ".ids").read_text().split() if Path(str(out) + ".ids").exists() else []
        seen = {r["test"] for r in done}
        for test_id in ids:
            if test_id not in seen:
                done.append({"test": test_id, "status": "timeout" if timed_out else "not run",
                             "seconds": None, "max_diff": None, "detail": log.read_text()[-2000:]})
        if not ids and not done:
            done.append({"test": module, "status": "error", "seconds": round(time.time() - t0, 1),
                         "max_diff": None, "detail": log.read_text()[-3000:]})
        for r in done:
            r["library"] = library
        records += done
        print(f"  {library:10s} {module:20s} {sum(r['status'] == 'pass' for r in done)}/{len(done)} passed "
              f"({time.time() - t0:.0f} s)", flush=True)
    return records


def reason(rec: dict) -> str:
    """A short why for a non-passing record."""
    if rec["status"] == "pass":
        return ""
    detail = rec.get("detail") or ""
    if rec.get("max_diff") is not None and "difference above the threshold" in detail:
        return f"diff {rec['max_diff']:.2e}"
    m = re.search(r"terminated with (signal \w+|exit code -?\d+)", detail)
    if m:
        return f"a rank {m.group(1)}"
    lines = [ln.strip() for ln in detail.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else rec["status"])[:90]


def short(test_id: str) -> str:
    return test_id.rsplit(".", 1)[-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkout", type=Path, help="a checkout of TorchShard's repository (has tests/ and torchshard/)")
    ap.add_argument("--only", choices=["torchshard", "autoshard"], help="run one library only")
    ap.add_argument("--repeat", type=int, default=1, help="run the suite N times (default 1)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per test file (default 900)")
    ap.add_argument("--json", type=Path, help="write every record to this JSON file")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (ported tests, logs)")
    args = ap.parse_args(argv)

    checkout = args.checkout.resolve()
    if not (checkout / "torchshard" / "__init__.py").exists():
        raise SystemExit(f"{checkout} is not a TorchShard checkout (no torchshard/__init__.py)")
    libraries = [args.only] if args.only else ["torchshard", "autoshard"]
    tmp = Path(tempfile.mkdtemp(prefix="torchshard_suite_"))
    records = []
    try:
        paths = {"autoshard": [REPO_ROOT]}
        if "torchshard" in libraries:
            paths["torchshard"], how = install_torchshard(checkout, tmp)
            paths["torchshard"] = [paths["torchshard"]]
            print(f"TorchShard: {how}")
        import torch
        print(f"torch {torch.__version__}, {RANKS} ranks on gloo, {os.cpu_count()} CPU cores; ported tests in {tmp}")
        for rep in range(args.repeat):
            for library in libraries:
                dest = tmp / f"run{rep}" / library / "tests"
                modules = port_tests(checkout, dest, library)
                for r in run_library(library, dest, modules, paths[library], args.timeout):
                    r["repeat"] = rep
                    records.append(r)
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    tests = sorted({r["test"] for r in records})
    table = {(r["library"], r["test"], r["repeat"]): r for r in records}
    width = max(len(short(t)) for t in tests)
    print()
    print(f"{'test':{width}s}  " + "  ".join(f"{lib:38s}" for lib in libraries))
    for t in tests:
        cells = []
        for lib in libraries:
            runs = [table[(lib, t, k)] for k in range(args.repeat) if (lib, t, k) in table]
            ok = sum(r["status"] == "pass" for r in runs)
            why = "; ".join(sorted({reason(r) for r in runs if r["status"] != "pass"}))
            cells.append(f"{ok}/{len(runs)} pass" + (f" ({why})" if why else ""))
        print(f"{short(t):{width}s}  " + "  ".join(f"{c[:38]:38s}" for c in cells))
    print()
    for lib in libraries:
        for k in range(args.repeat):
            runs = [r for r in records if r["library"] == lib and r["repeat"] == k]
            print(f"{lib}: {sum(r['status'] == 'pass' for r in runs)} of {len(runs)} passed"
                  + (f" (repeat {k + 1})" if args.repeat > 1 else ""))
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
