#!/usr/bin/env python3
"""The Grafana dashboard (deploy/grafana/moeline-stack.json): it is exactly what make_dashboard.py
writes (so an edit by hand does not drift from the script), every panel has a query, and every
query is valid PromQL — checked by `promtool check rules` on a rules file that records each query
($__rate_interval, Grafana's variable, replaced by 5m). That its metrics exist on a real stack is
checked by the stack_metrics test.

  test_dashboard.py
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRAFANA = os.path.join(ROOT, "deploy", "grafana")


def fail(message):
    print(f"dashboard: FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def main():
    promtool = shutil.which("promtool")
    if promtool is None:
        fail("promtool is not installed (Debian package prometheus; scripts/setup installs it)")
    committed_path = os.path.join(GRAFANA, "moeline-stack.json")
    with open(committed_path) as f:
        committed = f.read()
    with tempfile.TemporaryDirectory() as work:
        fresh_path = os.path.join(work, "moeline-stack.json")
        subprocess.run([sys.executable, os.path.join(GRAFANA, "make_dashboard.py"), "--out",
                        fresh_path], check=True, timeout=60)
        with open(fresh_path) as f:
            if f.read() != committed:
                fail("moeline-stack.json differs from what make_dashboard.py writes: run it and "
                     "commit both")
        dashboard = json.loads(committed)
        rules = []
        for panel in dashboard["panels"]:
            if panel["type"] == "row":
                continue
            targets = panel.get("targets", [])
            if not targets:
                fail(f"panel {panel['title']!r} has no query")
            for target in targets:
                expr = target["expr"].replace("$__rate_interval", "5m")
                rules.append({"record": f"dashboard:panel{panel['id']}:{target['refId']}",
                              "expr": expr})
        rules_path = os.path.join(work, "dashboard_rules.yml")
        with open(rules_path, "w") as f:
            yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, f)
        out = subprocess.run([promtool, "check", "rules", rules_path], capture_output=True,
                             text=True, timeout=60)
        if out.returncode != 0:
            fail(f"a dashboard query is not valid PromQL:\n{out.stdout}{out.stderr}")
    print(f"dashboard: ok: {len(rules)} queries in "
          f"{sum(p['type'] != 'row' for p in dashboard['panels'])} panels parse")


if __name__ == "__main__":
    main()
