#!/usr/bin/env python3
"""The Kubernetes manifests (deploy/k8s): every overlay renders with `kubectl kustomize`, every
object is valid against the Kubernetes API's schemas (k8s_validate.mjs, kubernetes-models), and
what the manifests say about moeline is what the binary has:

- each container runs `moeline <stage>` with flags that `moeline <stage> --help` lists, and
  MOELINE_* environment settings that are keys of that stage;
- the metrics port is the one --http binds, liveness probes /livez and readiness /readyz on it;
- --hub and --gateway name the gateway's Service and the ports it binds (--hub-bind,
  --client-bind); every Service selects a workload and targets ports its containers declare;
- every PodDisruptionBudget and HorizontalPodAutoscaler targets a workload; the custom metrics
  the autoscalers read are exposed by the prometheus-adapter rules (whose metric names the
  stack_metrics test checks against a real stack);
- drain fits: terminationGracePeriodSeconds exceeds --drain-grace-ms;
- the Curve key files mounted are those `moeline keys init` writes; every file a flag names lies in
  a mounted volume; the HTTP front checks API keys where the gateway does; one image throughout.

  test_k8s.py --moeline BUILD/stages/moeline [--kubectl kubectl]
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K8S = os.path.join(ROOT, "deploy", "k8s")
HERE = os.path.dirname(os.path.abspath(__file__))
OVERLAYS = ("dev", "cpu", "cuda")
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")


def fail(message):
    print(f"k8s: FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def check(condition, message):
    if not condition:
        fail(message)


def stage_keys(moeline, stage, cache={}):
    """The settings `moeline <stage> --help` lists."""
    if stage not in cache:
        out = subprocess.run([moeline, stage, "--help"], capture_output=True, text=True,
                             timeout=60)
        keys = set(re.findall(r"^  --([a-z0-9-]+)", out.stdout + out.stderr, re.M))
        check(keys, f"`moeline {stage} --help` lists no settings: {out.stdout[:300]}")
        cache[stage] = keys
    return cache[stage]


def flags(args):
    """{flag: value} of an argument list after the subcommand."""
    out, i = {}, 1
    while i < len(args):
        check(args[i].startswith("--"), f"argument {args[i]!r} is not a --flag (args {args})")
        value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
        out[args[i][2:]] = value
        i += 2 if value is not None else 1
    return out


def port_of(address):
    return int(address.rsplit(":", 1)[1])


def check_overlay(name, objects, moeline, adapter_metrics):
    by_kind = {}
    for obj in objects:
        by_kind.setdefault(obj["kind"], {})[obj["metadata"]["name"]] = obj
    workloads = {n: o for kind in WORKLOADS for n, o in by_kind.get(kind, {}).items()}
    check(workloads, f"{name}: no workloads")
    gateway_service = by_kind.get("Service", {}).get("moeline-gateway")
    check(gateway_service, f"{name}: no moeline-gateway Service")
    service_ports = {p["name"]: p for p in gateway_service["spec"]["ports"]}
    images = set()
    keys_files = set()
    with tempfile.TemporaryDirectory() as keys_dir:
        subprocess.run([moeline, "keys", "init", "--dir", keys_dir], capture_output=True,
                       check=True, timeout=60)
        keys_files = set(os.listdir(keys_dir))
    stages_seen = set()
    api_keys_of = {}
    for wname, workload in workloads.items():
        pod = workload["spec"]["template"]
        spec = pod["spec"]
        labels = pod["metadata"].get("labels", {})
        selector = workload["spec"]["selector"]["matchLabels"]
        check(all(labels.get(k) == v for k, v in selector.items()),
              f"{name}/{wname}: the selector {selector} does not match the pod's labels {labels}")
        for volume in spec.get("volumes", []):
            secret = volume.get("secret")
            if secret and secret["secretName"] == "moeline-curve-keys":
                for item in secret.get("items", []):
                    check(item["key"] in keys_files,
                          f"{name}/{wname}: mounts {item['key']}, which `moeline keys init` "
                          f"does not write ({sorted(keys_files)})")
        for container in spec.get("initContainers", []) + spec["containers"]:
            images.add(container["image"])
        for container in spec["containers"]:
            where = f"{name}/{wname}/{container['name']}"
            check(container.get("command") == ["moeline"], f"{where}: command is not [moeline]")
            args = container["args"]
            stage = args[0]
            stages_seen.add(stage)
            known = stage_keys(moeline, stage)
            settings = flags(args)
            for flag in settings:
                check(flag in known, f"{where}: `moeline {stage}` has no --{flag}")
            env_names = [e["name"] for e in container.get("env", [])]
            for env_from in container.get("envFrom", []):
                ref = env_from.get("configMapRef", {}).get("name")
                config_map = by_kind.get("ConfigMap", {}).get(ref)
                check(config_map, f"{where}: envFrom names ConfigMap {ref}, which is not there")
                env_names += list(config_map.get("data", {}))
            for env in env_names:
                if env.startswith("MOELINE_"):
                    key = env[len("MOELINE_"):].lower().replace("_", "-")
                    # A setting shared through one ConfigMap applies to the stages that have it.
                    check(any(key in stage_keys(moeline, s)
                              for s in ("gateway", "probe", "offload", "prefill", "decode",
                                        "http")),
                          f"{where}: {env} is no stage's setting")
            ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
            check("http" in settings and port_of(settings["http"]) == ports.get("metrics"),
                  f"{where}: --http {settings.get('http')} is not the metrics port {ports}")
            for probe, path in (("livenessProbe", "/livez"), ("readinessProbe", "/readyz")):
                get = container.get(probe, {}).get("httpGet", {})
                check(get.get("path") == path and get.get("port") in ("metrics",
                                                                       ports.get("metrics")),
                      f"{where}: {probe} is {get}, expected {path} on the metrics port")
            if "hub" in settings:
                check(settings["hub"] == f"tcp://moeline-gateway:{service_ports['hub']['port']}",
                      f"{where}: --hub {settings['hub']} is not the gateway Service's hub port")
            if "gateway" in settings:
                check(settings["gateway"] ==
                      f"tcp://moeline-gateway:{service_ports['client']['port']}",
                      f"{where}: --gateway {settings['gateway']} is not the gateway's client port")
            if stage == "gateway":
                for flag, port in (("hub-bind", "hub"), ("client-bind", "client")):
                    check(port_of(settings[flag]) == ports.get(port),
                          f"{where}: --{flag} {settings[flag]} is not container port {port}")
            if stage == "http":
                check(port_of(settings["listen"]) == ports.get("api"),
                      f"{where}: --listen {settings['listen']} is not the api port")
            # Every file a flag names is in a volume the container mounts.
            mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
            for flag in ("api-keys", "server-key", "curve-dir"):
                if settings.get(flag):
                    check(any(settings[flag] == m or settings[flag].startswith(m.rstrip("/") + "/")
                              for m in mounts),
                          f"{where}: --{flag} {settings[flag]} is in no mounted volume {mounts}")
            api_keys_of[stage] = settings.get("api-keys")
            grace = int(settings.get("drain-grace-ms") or 30000) / 1000
            check(spec.get("terminationGracePeriodSeconds", 30) > grace,
                  f"{where}: terminationGracePeriodSeconds does not exceed the drain grace "
                  f"({grace} s)")
    check(stages_seen >= {"gateway", "probe", "offload", "prefill", "decode", "http"},
          f"{name}: stages {sorted(stages_seen)}")
    # With keys at the gateway, the HTTP front checks them too, or /v1/models, /tokenize and
    # /detokenize answer anyone.
    check(bool(api_keys_of.get("gateway")) == bool(api_keys_of.get("http")),
          f"{name}: --api-keys at the gateway {api_keys_of.get('gateway')} but at the HTTP front "
          f"{api_keys_of.get('http')}")
    bases = {image.split(":")[0] for image in images}
    check(len(bases) == 1 and bases <= {"moeline", "moeline-cuda"},
          f"{name}: images {sorted(images)}")
    for sname, service in by_kind.get("Service", {}).items():
        selected = [w for w in workloads.values()
                    if all(w["spec"]["template"]["metadata"]["labels"].get(k) == v
                           for k, v in service["spec"]["selector"].items())]
        check(len(selected) == 1, f"{name}: Service {sname} selects {len(selected)} workloads")
        names = {p["name"] for c in selected[0]["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            check(port["targetPort"] in names,
                  f"{name}: Service {sname} targets port {port['targetPort']} no container has")
    for pname, pdb in by_kind.get("PodDisruptionBudget", {}).items():
        match = pdb["spec"]["selector"]["matchLabels"]
        check(any(all(w["spec"]["template"]["metadata"]["labels"].get(k) == v
                      for k, v in match.items()) for w in workloads.values()),
              f"{name}: PodDisruptionBudget {pname} selects nothing")
    for hname, hpa in by_kind.get("HorizontalPodAutoscaler", {}).items():
        target = hpa["spec"]["scaleTargetRef"]
        check(target["name"] in by_kind.get(target["kind"], {}),
              f"{name}: HorizontalPodAutoscaler {hname} targets a missing {target}")
        for metric in hpa["spec"]["metrics"]:
            if metric["type"] == "Pods":
                check(metric["pods"]["metric"]["name"] in adapter_metrics,
                      f"{name}: {hname} scales on {metric['pods']['metric']['name']}, which the "
                      f"prometheus-adapter rules do not expose ({sorted(adapter_metrics)})")
    return len(objects)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moeline", required=True)
    ap.add_argument("--kubectl", default=shutil.which("kubectl") or "kubectl")
    args = ap.parse_args()
    if not shutil.which(args.kubectl):
        fail("kubectl is not installed (Debian package kubernetes-client; scripts/setup installs "
             "it)")
    if not os.path.isdir(os.path.join(HERE, "node_modules", "kubernetes-models")):
        fail("tests/deploy/node_modules is missing: scripts/setup runs npm ci there")
    with open(os.path.join(K8S, "prometheus-adapter", "rules.yaml")) as f:
        rules = yaml.safe_load(f)["rules"]
    adapter_metrics = set()
    for rule in rules:
        series = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)", rule["seriesQuery"]).group(1)
        check(rule["name"]["as"] == "${1}" and rule["name"]["matches"] == "^(.*)$",
              f"adapter rule for {series}: exposed under another name")
        adapter_metrics.add(series)
    for overlay in OVERLAYS:
        out = subprocess.run([args.kubectl, "kustomize", os.path.join(K8S, "overlays", overlay)],
                             capture_output=True, text=True, timeout=120)
        check(out.returncode == 0, f"kubectl kustomize {overlay}: {out.stderr[-600:]}")
        objects = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
        valid = subprocess.run(["node", os.path.join(HERE, "k8s_validate.mjs")], input=out.stdout,
                               capture_output=True, text=True, timeout=120, cwd=HERE)
        bad = [json.loads(line) for line in valid.stdout.splitlines() if line.startswith("{")]
        bad = [b for b in bad if not b["ok"]]
        check(valid.returncode == 0 and not bad,
              f"{overlay}: objects invalid against the Kubernetes schemas: {bad or valid.stderr}")
        count = check_overlay(overlay, objects, args.moeline, adapter_metrics)
        print(f"k8s: ok: overlay {overlay}: {count} objects valid and consistent with moeline")


if __name__ == "__main__":
    main()
