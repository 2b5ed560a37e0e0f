"""Let a FLARE startup kit run fedmed jobs, which carry no code: ``python -m fedmed_flare.kit KIT_FOLDER``.

FLARE builds the components of a job without custom code only from the classes its site allows
(``class_allow_list`` in ``local/resources.json``; a provisioned kit ships ``local/resources.json.default`` with
FLARE's own list). This writes ``local/resources.json`` — the kit's current settings (``resources.json``, else the
shipped default) with fedmed's adapters (:data:`fedmed_flare.ALLOW_LIST`) added to the list, and **live log
streaming off** (``allow_log_streaming: false``) unless the kit's owner passes ``--allow-log-streaming``.
Run it once in the server's kit and in every site's kit before starting them (docs/deployment.md §4).

Log streaming: a provisioned FLARE 2.9 kit streams every job's full site log to the server by default (its
``SiteLogStreamer`` injects FLARE's ``JobLogStreamer``, which is on FLARE's default class allow-list, into every job;
the server's ``JobLogReceiver`` stores what arrives). A site's log holds what its operator needs and no other party
should see (its folder names, tracebacks from its data), so a site sends it only when it turns streaming on itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fedmed_flare import ALLOW_LIST, allow_list

__all__ = ["FLARE_TRACKERS", "allow_fedmed", "main"]

# FLARE's own receivers that send a job's metrics wherever the job says (an MLflow server, W&B online): taken off the
# kit's allow list; fedmed's subclasses (fedmed_flare.mlflow_receiver, fedmed_flare.wandb_receiver) replace them and
# send only where the party's policy allows (fedmed_flare.tracking)
FLARE_TRACKERS = ("nvflare.app_opt.tracking.mlflow.mlflow_receiver.MLflowReceiver",
                  "nvflare.app_opt.tracking.wandb.wandb_receiver.WandBReceiver")


def allow_fedmed(kit, *, log_streaming: bool = False) -> Path:
    """Add fedmed's adapters to the kit's ``class_allow_list`` (and take FLARE's own MLflow and W&B receivers,
    :data:`FLARE_TRACKERS`, off it) and set its ``allow_log_streaming`` (off unless ``log_streaming``); returns the
    ``local/resources.json`` written."""
    local = Path(kit) / "local"
    if not local.is_dir():
        raise FileNotFoundError(f"{kit}: not a FLARE startup kit (no local/ folder)")
    target = local / "resources.json"
    source = target if target.is_file() else local / "resources.json.default"
    doc = _resources(source) if source.is_file() else {"format_version": 2}
    have = doc.get("class_allow_list")
    if have is not None and (not isinstance(have, list) or not all(isinstance(p, str) for p in have)):
        raise ValueError(f"{kit}: local/{source.name}: class_allow_list should be a list of class paths, got "
                         f"{type(have).__name__}")
    doc["class_allow_list"] = (allow_list() if have is None
                               else list(have) + [p for p in ALLOW_LIST if p not in have])
    doc["class_allow_list"] = [p for p in doc["class_allow_list"] if p not in FLARE_TRACKERS]
    doc["allow_log_streaming"] = bool(log_streaming)
    target.write_text(json.dumps(doc, indent=2))
    return target


def _resources(f: Path) -> dict:
    """A kit's ``resources.json`` (or its shipped default) as the JSON object it must be; one line naming it if not."""
    try:
        doc = json.loads(f.read_text())
    except ValueError as e:
        raise ValueError(f"local/{f.name} is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"local/{f.name} should be a JSON object (FLARE's resources), got a {type(doc).__name__}")
    return doc


def _current_streaming(kit) -> str | None:
    """The kit's own ``local/resources.json`` setting of ``allow_log_streaming`` as it is written there (``true``,
    ``false``, or e.g. ``"false"``, a string FLARE takes as on); None when not set or not readable."""
    f = Path(kit) / "local" / "resources.json"
    try:
        v = _resources(f).get("allow_log_streaming") if f.is_file() else None
    except (OSError, ValueError):
        return None
    if v is None:
        return None
    return str(v).lower() if isinstance(v, bool) else f"{json.dumps(v)}, which FLARE takes as " \
        f"{'on' if v else 'off'}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kits", nargs="+", help="startup kit folders (the server's and the sites')")
    ap.add_argument("--allow-log-streaming", action="store_true",
                    help="let FLARE stream this kit's job logs to the server (off unless given: a site's log stays "
                         "at the site)")
    a = ap.parse_args(argv)
    for kit in a.kits:
        try:
            was = _current_streaming(kit)
            f = allow_fedmed(kit, log_streaming=a.allow_log_streaming)
            note = "" if was is None or was == str(a.allow_log_streaming).lower() else f" (was {was})"
            print(f"{f}: class_allow_list allows {', '.join(ALLOW_LIST)}; allow_log_streaming "
                  f"{str(a.allow_log_streaming).lower()}{note}")
        except (OSError, ValueError) as e:
            msg = str(e) if str(e).startswith(str(kit)) else f"{kit}: {e}"
            print(f"fedmed_flare.kit: error: {msg}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
