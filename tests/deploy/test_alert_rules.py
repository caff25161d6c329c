#!/usr/bin/env python3
"""The alert rules (deploy/prometheus/alerts.yml) under `promtool check rules` and `promtool test
rules` with the synthetic series of alerts_test.yml. The expected annotations of each firing alert
are filled in from the rule itself (its {{ $labels.NAME }} templates substituted with the expected
labels), so a case states only when an alert fires and with which labels; every alert of the
rules file must be seen firing in some case and silent in another.

  test_alert_rules.py [--rules deploy/prometheus/alerts.yml] [--tests deploy/prometheus/alerts_test.yml]
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LABEL_TEMPLATE = re.compile(r"\{\{\s*\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")
ANY_TEMPLATE = re.compile(r"\{\{.*?\}\}")


def fail(message):
    print(f"alert_rules: FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def rules_by_alert(rules_doc):
    rules = {}
    for group in rules_doc["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                if rule["alert"] in rules:
                    fail(f"alert {rule['alert']} is defined twice")
                rules[rule["alert"]] = rule
    return rules


def render(text, labels, alert):
    def label(match):
        name = match.group(1)
        if name not in labels:
            fail(f"{alert}: an annotation uses $labels.{name}, which the case does not expect")
        return str(labels[name])
    rendered = LABEL_TEMPLATE.sub(label, text)
    if ANY_TEMPLATE.search(rendered):
        fail(f"{alert}: annotations may only use {{{{ $labels.NAME }}}} templates: {text!r}")
    return rendered


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rules", default=os.path.join(ROOT, "deploy", "prometheus", "alerts.yml"))
    ap.add_argument("--tests",
                    default=os.path.join(ROOT, "deploy", "prometheus", "alerts_test.yml"))
    args = ap.parse_args()
    promtool = shutil.which("promtool")
    if promtool is None:
        fail("promtool is not installed (Debian package prometheus; scripts/setup installs it)")

    with open(args.rules) as f:
        rules = rules_by_alert(yaml.safe_load(f))
    with open(args.tests) as f:
        tests = yaml.safe_load(f)

    fired, silent = set(), set()
    for case in tests["tests"]:
        for check in case.get("alert_rule_test", []):
            alert = check["alertname"]
            if alert not in rules:
                fail(f"case {case.get('name')!r} tests {alert}, which alerts.yml does not define")
            expected = check.get("exp_alerts") or []
            (fired if expected else silent).add(alert)
            for exp in expected:
                labels = dict(exp.get("exp_labels", {}))
                labels.setdefault("alertname", alert)
                exp["exp_annotations"] = {
                    key: render(value, labels, alert)
                    for key, value in rules[alert].get("annotations", {}).items()}
    for alert in sorted(rules):
        if alert not in fired:
            fail(f"no case sees {alert} fire")
        if alert not in silent:
            fail(f"no case sees {alert} stay silent")

    with tempfile.TemporaryDirectory() as work:
        shutil.copy(args.rules, os.path.join(work, os.path.basename(args.rules)))
        # The scrape config shipped beside the rules (a local stack's, with its run directory
        # filled in), checked whole by promtool, rule files included. (prometheus-k8s.yml is not:
        # Debian's Prometheus is built without Kubernetes service discovery, and its promtool
        # refuses kubernetes_sd_configs.)
        for config in ("prometheus.yml",):
            with open(os.path.join(os.path.dirname(args.rules), config)) as f:
                text = f.read().replace("DIR/", work + "/")
            path = os.path.join(work, config)
            with open(path, "w") as f:
                f.write(text)
            out = subprocess.run([promtool, "check", "config", path], capture_output=True,
                                 text=True, timeout=120)
            print(out.stdout + out.stderr, end="")
            if out.returncode != 0:
                fail(f"promtool check config {config} failed")
        tests["rule_files"] = [os.path.basename(args.rules)]
        test_file = os.path.join(work, "alerts_test.yml")
        with open(test_file, "w") as f:
            yaml.safe_dump(tests, f, sort_keys=False)
        for command in ([promtool, "check", "rules", os.path.join(work, os.path.basename(
                args.rules))], [promtool, "test", "rules", test_file]):
            out = subprocess.run(command, capture_output=True, text=True, timeout=120)
            print(out.stdout + out.stderr, end="")
            if out.returncode != 0:
                fail(f"{' '.join(command[1:3])} failed")
    print(f"alert_rules: ok: {len(rules)} alerts, each seen firing and silent")


if __name__ == "__main__":
    main()
