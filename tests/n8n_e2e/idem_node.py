"""The n8n-nodes-idem package (integrations/n8n-nodes-idem) for the end-to-end check.

It is built as from a fresh clone (`npm ci && npm run build`, the lockfile pinned), packed with
`npm pack` (so only what npm would publish is used), and unpacked into the n8n home's
community-nodes folder, `<N8N_USER_FOLDER>/.n8n/nodes/node_modules/n8n-nodes-idem`: where
`npm install n8n-nodes-idem` puts it in a self-hosted n8n. n8n loads it from there under the
package's name, so the node type is `n8n-nodes-idem.idem`, as examples/n8n/04 names it. (A folder
given in N8N_CUSTOM_EXTENSIONS loads as `CUSTOM.idem`, a type no shared workflow names.) The
package carries no node_modules: n8n resolves `n8n-workflow` to its own copy.
"""

from __future__ import annotations

import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from tests.n8n_e2e.n8n import N8nUnavailable
from tests.support import ROOT

PACKAGE = ROOT / "integrations" / "n8n-nodes-idem"
NAME = "n8n-nodes-idem"


def _npm(args: list[str], log_dir: Path) -> str:
    if shutil.which("npm") is None:
        raise N8nUnavailable("npm is not on PATH: install Node 20 (with npm) first")
    with (log_dir / "idem-node-build.log").open("ab") as log:
        log.write(f"\n$ npm {' '.join(args)}\n".encode())
        log.flush()
        done = subprocess.run(
            ["npm", *args],
            cwd=PACKAGE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=600,
            check=False,
        )
        log.write(done.stdout)
    text = done.stdout.decode(errors="replace")
    if done.returncode != 0:
        raise N8nUnavailable(f"npm {' '.join(args)} failed in {PACKAGE}:\n{text[-3000:]}")
    return text


def install(n8n_home: Path, log_dir: Path) -> Path:
    """Build, pack and unpack the package into `n8n_home`'s community-nodes folder."""
    _npm(["ci", "--no-audit", "--no-fund"], log_dir)
    _npm(["run", "build"], log_dir)
    target = n8n_home / ".n8n" / "nodes" / "node_modules" / NAME
    with tempfile.TemporaryDirectory(prefix="idem-node-pack-") as folder:
        # --ignore-scripts: the build above is the one packed (no prepack rebuild).
        _npm(["pack", "--ignore-scripts", "--pack-destination", folder], log_dir)
        (tarball,) = Path(folder).glob(f"{NAME}-*.tgz")
        with tarfile.open(tarball) as archive:
            archive.extractall(folder, filter="data")
        shutil.copytree(Path(folder) / "package", target)
    if not (target / "dist" / "nodes" / "Idem" / "Idem.node.js").exists():
        raise N8nUnavailable(f"the packed {NAME} has no dist/nodes/Idem/Idem.node.js")
    return target
