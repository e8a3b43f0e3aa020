"""`python -m tests.n8n_e2e [--only TEXT] [--keep]`: one line per case, a summary, exit 1 on a
failure (2 when n8n cannot be installed or started)."""

from __future__ import annotations

import argparse
import sys

from tests.n8n_e2e import n8n
from tests.n8n_e2e.cases import CASES, run_case
from tests.n8n_e2e.fan_out import CASES as FAN_OUT_CASES
from tests.n8n_e2e.trigger_cases import CASES as TRIGGER_CASES
from tests.n8n_e2e.world import world


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.n8n_e2e", description=__doc__)
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    parser.add_argument("--keep", action="store_true", help="keep the run's folder (logs, n8n)")
    args = parser.parse_args(argv)
    try:
        binary = n8n.install()
    except (n8n.N8nUnavailable, OSError) as error:
        print(f"n8n unavailable: {error}", file=sys.stderr)
        return 2
    cases = [case for case in [*CASES, *FAN_OUT_CASES, *TRIGGER_CASES] if args.only in case.name]
    outcomes = []
    errors: list[str] = []
    try:
        with world(binary, keep=args.keep) as running:
            version = n8n.version(binary)
            print(f"n8n {version}, gateway {running.stack.url}, CRM {running.crm.url}", flush=True)
            for case in cases:
                outcome = run_case(running, case)
                outcomes.append((case, outcome))
                print(outcome.line(), flush=True)
            errors = n8n.execution_errors(running.n8n.home)
    except n8n.N8nUnavailable as error:
        print(f"n8n did not run: {error}", file=sys.stderr)
        return 2
    failed = [(case, outcome) for case, outcome in outcomes if not outcome.passed]
    passed = len(outcomes) - len(failed)
    print(f"summary: {passed} passed, {len(failed)} failed of {len(outcomes)} cases")
    waiting = [case.name for case, _ in failed if case.uncertain]
    if waiting:
        print(
            "failed cases that need the claims contract with `uncertain` and `/fail` `effect`: "
            + ", ".join(waiting)
        )
    for line in errors:
        print(f"n8n execution failed: {line}")
    print("logs: test-artifacts/n8n-e2e/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
