"""Run a fedmed job in NVFlare POC mode: named sites on loopback, submitted through the admin API.

This is the path a clinical team uses from the FLARE admin console (``submit_job``), scripted:

    python poc/run_poc.py JOB_DIR --datalists DIR [--site-policy POLICY] [--workspace WS] [--result-dir RESULT] \
        [--start-timeout S] [--keep]

1. ``nvflare poc prepare -c <the job's sites> --force`` into the workspace (``--workspace``, else
   ``NVFLARE_POC_WORKSPACE``, else ``/tmp/fedmed_poc``). The nvflare commands run with ``HOME`` set to a
   folder inside the workspace, so ``poc prepare`` does not rewrite the user's ``~/.nvflare/config.conf``.
2. Each site's data setting goes where a hospital would put it: ``<site kit>/local/fedmed_site.json``
   naming ``DIR/<site>.json``, and ``--site-policy`` (if given) as ``local/fedmed_policy.json``; every kit's
   ``class_allow_list`` allows fedmed's adapters (``python -m fedmed_flare.kit``; docs/deployment.md).
3. ``nvflare poc start --no-wait`` (server + sites in the background); this script then waits up to
   ``--start-timeout`` seconds for every site of the job to connect, through the admin API. FLARE's own readiness
   wait (``poc start`` without ``--no-wait``) polls with admin commands that have no time limit of their own and
   was seen to hang past two minutes on a loaded 2-core machine.
4. admin API: ``new_secure_session`` -> ``submit_job`` -> ``monitor_job`` -> ``download_job_result``.
5. ``nvflare poc stop`` and ``nvflare poc clean`` (always, also on failure, unless ``--keep``).

A job deployed to every connected site (``jobs/build.py --all-sites``) needs ``--sites``. Prints the job
id, FLARE's final status, the fedmed run status (``metrics.json``) and where the result was downloaded;
exit code 0 only when the run finished.
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
    return sorted({s for targets in meta.get("deploy_map", {}).values() for s in targets
                   if s not in ("server", "@ALL", "@all")})


def find_kit(ws: Path, name: str) -> Path:
    kits = [k for k in ws.rglob(name) if (k / "startup").is_dir()]
    if not kits:
        raise RuntimeError(f"{ws}: no startup kit for {name} after 'poc prepare'")
    return kits[0]


def write_site_settings(ws: Path, sites: list[str], datalists: Path | None, policy: Path | None = None) -> None:
    """Each site's own data setting and policy, in its startup kit's local/ folder (FLARE's convention); the server's
    and every site's kit allow fedmed's adapters."""
    from fedmed_flare.kit import allow_fedmed

    for s in sites:
        local = find_kit(ws, s) / "local"
        local.mkdir(exist_ok=True)
        if datalists is not None:
            dl = datalists / f"{s}.json"
            if not dl.is_file():
                raise RuntimeError(f"{dl}: no datalist for site {s}")
            (local / "fedmed_site.json").write_text(json.dumps({"datalist": str(dl.resolve())}, indent=1))
        if policy is not None:
            shutil.copy(policy, local / "fedmed_policy.json")
        allow_fedmed(local.parent)
    allow_fedmed(find_kit(ws, "server"))


def connect(kit: Path, deadline: float, want_sites: list[str]):
    from nvflare.fuel.flare_api.flare_api import new_secure_session

    last = None
    while time.time() < deadline:
        sess = None
        try:
            sess = new_secure_session(ADMIN, str(kit), timeout=10.0)
            # ClientInfo objects (FLARE 2.9), dicts or names
            clients = [c.get("name", "") if isinstance(c, dict) else getattr(c, "name", c)
                       for c in (sess.get_connected_client_list() or [])]
            if set(want_sites) <= set(clients):
                return sess
            last = f"connected {sorted(clients)}, waiting for {sorted(set(want_sites) - set(clients))}"
        except Exception as e:  # server not up yet
            last = f"{type(e).__name__}: {e}"
        if sess is not None:
            sess.close()
        time.sleep(2)
    raise TimeoutError(f"POC did not come up in time ({last})")


def console_tails(ws: Path, lines: int = 15) -> str:
    """The last lines of every POC participant's console log (``poc_console.log`` beside its startup folder)."""
    out = []
    for log in sorted(ws.rglob("poc_console.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {log.parent.name}/{log.name} ---\n" + "\n".join(tail))
    return "\n".join(out) or "(no POC console logs)"


def poc_env(workspace: Path) -> dict:
    home = workspace / ".home"
    home.mkdir(parents=True, exist_ok=True)
    return dict(os.environ, NVFLARE_POC_WORKSPACE=str(workspace), HOME=str(home))


def run(job_dir: Path, workspace: Path, result_dir: Path, sites: list[str], datalists: Path | None, timeout: int,
        keep: bool, policy: Path | None = None, start_timeout: float = 300.0) -> dict:
    env = poc_env(workspace)
    nv = nvflare_bin()
    sh([nv, "poc", "prepare", "-c", *sites, "--force"], env)
    write_site_settings(workspace, sites, datalists, policy)
    out: dict = {"job": str(job_dir)}
    try:
        sh([nv, "poc", "start", "--no-wait"], env, timeout=120)
        try:
            sess = connect(find_kit(workspace, ADMIN), time.time() + start_timeout, sites)
        except TimeoutError as e:
            raise TimeoutError(f"{e}\n{console_tails(workspace)}") from None
        try:
            job_id = sess.submit_job(str(job_dir))
            print(f"submitted {job_dir.name} as job {job_id}", flush=True)
            t0 = time.time()
            rc = sess.monitor_job(job_id, timeout=timeout)
            status = sess.get_job_meta(job_id).get("status")
            print(f"job {job_id}: monitor {rc}, FLARE status {status}, {time.time() - t0:.0f} s", flush=True)
            downloaded = sess.download_job_result(job_id)
            result_dir.mkdir(parents=True, exist_ok=True)
            target = result_dir / job_id
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(downloaded, target)
            out.update(job_id=job_id, flare_status=str(status), result=str(target))
            rec = sorted(target.rglob("fedmed/metrics.json"))
            doc = json.loads(rec[0].read_text()) if rec else {}
            out.update(status=doc.get("status", "failed"), reason=doc.get("reason", "no fedmed record in the result"))
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("job_dir", help="a job folder from jobs/build.py")
    ap.add_argument("--datalists", help="folder holding <site>.json for every site (written into each site's "
                    "local/fedmed_site.json)")
    ap.add_argument("--site-policy", help="a fedmed_policy.json every POC site keeps in its local/ folder (default: "
                    "none, the default policy)")
    ap.add_argument("--sites", nargs="+", help="POC site names (default: those in the job's deploy map)")
    ap.add_argument("--workspace", default=os.environ.get("NVFLARE_POC_WORKSPACE", "/tmp/fedmed_poc"),
                    help="POC workspace (default: NVFLARE_POC_WORKSPACE, else /tmp/fedmed_poc)")
    ap.add_argument("--result-dir", default="results/poc", help="where the downloaded job result goes")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds to wait for the job")
    ap.add_argument("--start-timeout", type=float, default=300.0,
                    help="seconds to wait for the server and every site to connect after 'poc start'")
    ap.add_argument("--keep", action="store_true", help="leave the POC running")
    a = ap.parse_args(argv)
    job = Path(a.job_dir).resolve()
    if not (job / "meta.json").is_file():
        print(f"{job}: not a job folder (no meta.json)", file=sys.stderr)
        return 2
    named = job_sites(job)
    sites = a.sites or named
    if not sites:
        print(f"{job}: the job deploys to every connected site; pass --sites NAME ...", file=sys.stderr)
        return 2
    if named and set(named) - set(sites):
        print(f"{job}: the job names sites {named} but --sites gives {sites}", file=sys.stderr)
        return 2
    res = run(job, Path(a.workspace).resolve(), Path(a.result_dir).resolve(), sites,
              Path(a.datalists).resolve() if a.datalists else None, a.timeout, a.keep,
              Path(a.site_policy).resolve() if a.site_policy else None, a.start_timeout)
    print(json.dumps(res, indent=1))
    return 0 if res.get("status") == "finished" else 1


if __name__ == "__main__":
    sys.exit(main())
