"""`python -m tests.n8n_e2e.screenshot [OUT]`: a PNG of examples/n8n/04 in the editor of the
end-to-end check's real n8n (the same world: package installed, credentials, workflows), taken
in headless Chromium by integrations/n8n-nodes-idem/scripts/screenshot.js.

Not part of `make test` or `make n8n-e2e`: it needs Chromium (CHROMIUM, default
/usr/bin/chromium) and installs playwright-core from npm into a temporary folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.n8n_e2e import n8n
from tests.n8n_e2e.idem_node import PACKAGE
from tests.n8n_e2e.world import EXAMPLES, world
from tests.support import ROOT

DEFAULT_OUT = ROOT / "docs" / "img" / "n8n-idem-node.png"
WORKFLOW = "04-claim-with-idem-node.json"
# The driver only: it launches the system's Chromium and downloads no browser.
PLAYWRIGHT = "playwright-core@1.65.1"


def main(argv: list[str]) -> int:
    """`python -m tests.n8n_e2e.screenshot [OUT.png [EXAMPLE.json]]`: the example workflow
    (04 by default) as n8n's editor shows it."""
    out = Path(argv[0]).resolve() if argv else DEFAULT_OUT
    example = argv[1] if len(argv) > 1 else WORKFLOW
    out.parent.mkdir(parents=True, exist_ok=True)
    workflow_id = json.loads((EXAMPLES / example).read_text(encoding="utf-8"))["id"]
    binary = n8n.install()
    with tempfile.TemporaryDirectory(prefix="idem-playwright-") as driver:
        subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--prefix", driver, PLAYWRIGHT],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        env = {**os.environ, "NODE_PATH": str(Path(driver) / "node_modules")}
        with world(binary) as running:
            subprocess.run(
                ["node", "scripts/screenshot.js", running.n8n.url, workflow_id, str(out)],
                cwd=PACKAGE,
                env=env,
                check=True,
            )
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
