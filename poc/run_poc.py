"""Run a fedmed job in NVFlare POC mode: N sites on loopback, submitted through the admin API.

This is the path a clinical team uses from the FLARE admin console (``submit_job``), scripted:

    python poc/run_poc.py JOB_DIR --sites 4 --workspace /tmp/fedmed_poc --result-dir RESULT [--keep]

1. ``nvflare poc prepare -c site-1 ... site-N --force`` (workspace from ``NVFLARE_POC_WORKSPACE``)
2. ``nvflare poc start`` (server + sites + admin in the background)
3. admin API: ``new_secure_session`` -> ``submit_job`` -> ``monitor_job`` -> ``download_job_result``
4. ``nvflare poc stop`` and ``nvflare poc clean`` (always, also on failure, unless ``--keep``)

Prints the job id, its final status and where the result was downloaded; exit code 0 only when
the job finished successfully.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ADMIN = "admin@nvidia.com"


def nvflare_bin() -> str:
    cand = Path(sys.executable).parent / "nvflare"
    return str(cand) if cand.exists() else "nvflare"


def sh(args, env, timeout=300, check=True, capture=True):
    print("$", " ".join(args), flush=True)
    p = subprocess.run(args, env=env, timeout=timeout, input="y\n", text=True,
                       stdout=subprocess.PIPE if capture else None, stderr=subprocess.STDOUT if capture else None)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({p.returncode}):\n{(p.stdout or '')[-2000:]}")
    return p


def job_sites(job_dir: Path) -> list[str]:
    meta = json.loads((job_dir / "meta.json").read_text())
    sites = sorted({s for targets in meta.get("deploy_map", {}).values() for s in targets if s not in ("server", "@ALL")})
    return sites


def find_admin_kit(ws: Path) -> Path:
    kits = list(ws.rglob(ADMIN))
    kits = [k for k in kits if (k / "startup").is_dir()]
    if not kits:
        raise RuntimeError(f"{ws}: no admin startup kit for {ADMIN} after 'poc prepare'")
    return kits[0]


def connect(kit: Path, deadline: float, want_sites: int):
    from nvflare.fuel.flare_api.flare_api import new_secure_session

    last = None
    while time.time() < deadline:
        try:
            sess = new_secure_session(ADMIN, str(kit), timeout=10.0)
            clients = sess.get_connected_client_list() or []
            if len(clients) >= want_sites:
                return sess
            sess.close()
            last = f"{len(clients)}/{want_sites} sites connected"
        except Exception as e:  # server not up yet
            last = f"{type(e).__name__}: {e}"
        time.sleep(2)
    raise TimeoutError(f"POC did not come up in time ({last})")


def run(job_dir: Path, workspace: Path, result_dir: Path, sites: list[str], timeout: int, keep: bool) -> dict:
    env = dict(os.environ, NVFLARE_POC_WORKSPACE=str(workspace))
    nv = nvflare_bin()
    workspace.mkdir(parents=True, exist_ok=True)
    sh([nv, "poc", "prepare", "-c", *sites, "--force"], env)
    out: dict = {"job": str(job_dir)}
    try:
        sh([nv, "poc", "start"], env, timeout=120, check=False, capture=True)
        kit = find_admin_kit(workspace)
        sess = connect(kit, time.time() + 180, len(sites))
        try:
            job_id = sess.submit_job(str(job_dir))
            print(f"submitted {job_dir.name} as job {job_id}", flush=True)
            t0 = time.time()
            rc = sess.monitor_job(job_id, timeout=timeout)
            meta = sess.get_job_meta(job_id)
            status = meta.get("status")
            print(f"job {job_id}: monitor {rc}, status {status}, {time.time() - t0:.0f} s", flush=True)
            downloaded = sess.download_job_result(job_id)
            result_dir.mkdir(parents=True, exist_ok=True)
            target = result_dir / job_id
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(downloaded, target)
            out.update(job_id=job_id, status=str(status), result=str(target))
            print(f"result downloaded to {target}", flush=True)
        finally:
            sess.close()
    finally:
        if not keep:
            sh([nv, "poc", "stop"], env, timeout=120, check=False)
            time.sleep(2)
            sh([nv, "poc", "clean"], env, timeout=120, check=False)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job_dir")
    ap.add_argument("--sites", type=int, help="number of sites (default: those in the job's deploy map)")
    ap.add_argument("--workspace", default="/tmp/fedmed_poc")
    ap.add_argument("--result-dir", default="results/poc")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--keep", action="store_true", help="leave the POC running")
    a = ap.parse_args(argv)
    job = Path(a.job_dir).resolve()
    if not (job / "meta.json").is_file():
        print(f"{job}: not a job folder (no meta.json)", file=sys.stderr)
        return 2
    sites = job_sites(job)
    if a.sites and a.sites != len(sites):
        print(f"{job}: deploy map names {len(sites)} sites {sites}, not --sites {a.sites}", file=sys.stderr)
        return 2
    res = run(job, Path(a.workspace).resolve(), Path(a.result_dir).resolve(), sites, a.timeout, a.keep)
    print(json.dumps(res, indent=1))
    return 0 if "FINISHED_OK" in res.get("status", "") or res.get("status") == "FINISHED:COMPLETED" else 1


if __name__ == "__main__":
    sys.exit(main())
