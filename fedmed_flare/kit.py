"""Let a FLARE startup kit run fedmed jobs, which carry no code: ``python -m fedmed_flare.kit KIT_FOLDER``.

FLARE builds the components of a job without custom code only from the classes its site allows
(``class_allow_list`` in ``local/resources.json``; a provisioned kit ships ``local/resources.json.default`` with
FLARE's own list). This writes ``local/resources.json`` — the kit's current settings (``resources.json``, else the
shipped default) with fedmed's adapters (:data:`fedmed_flare.ALLOW_LIST`) added to the list and nothing else changed.
Run it once in the server's kit and in every site's kit before starting them (docs/deployment.md §4).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fedmed_flare import ALLOW_LIST, allow_list

__all__ = ["allow_fedmed", "main"]


def allow_fedmed(kit) -> Path:
    """Add fedmed's adapters to the kit's ``class_allow_list``; returns the ``local/resources.json`` written."""
    local = Path(kit) / "local"
    if not local.is_dir():
        raise FileNotFoundError(f"{kit}: not a FLARE startup kit (no local/ folder)")
    target = local / "resources.json"
    source = target if target.is_file() else local / "resources.json.default"
    doc = json.loads(source.read_text()) if source.is_file() else {"format_version": 2}
    have = doc.get("class_allow_list")
    doc["class_allow_list"] = (allow_list() if have is None
                               else list(have) + [p for p in ALLOW_LIST if p not in have])
    target.write_text(json.dumps(doc, indent=2))
    return target


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kits", nargs="+", help="startup kit folders (the server's and the sites')")
    a = ap.parse_args(argv)
    for kit in a.kits:
        try:
            print(f"{allow_fedmed(kit)}: class_allow_list allows {', '.join(ALLOW_LIST)}")
        except (OSError, ValueError) as e:
            print(f"fedmed_flare.kit: error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
