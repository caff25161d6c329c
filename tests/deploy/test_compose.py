#!/usr/bin/python3
"""docker-compose.yml and docker/Dockerfile hold what an operator relies on: five stages (each with
CurveZMQ keys from a one-shot keys service), scalable
ones (probe, prefill, decode) free of container names and host ports so `--scale` works, a health
check and a restart policy everywhere, workers pointed at the gateway's hub, and an image that
installs the runtime libraries and copies the binary and the demo model. The compose file is read
through `docker-compose config` (no daemon needed), so what is checked is what compose would run.

    test_compose.py --repo REPO [--docker-compose docker-compose]
"""
import argparse
import os
import re
import shlex
import subprocess
import sys

import yaml

failures = []

STAGES = ("gateway", "probe", "prefill", "decode", "offload", "http")
SCALABLE = ("probe", "prefill", "decode")
WORKERS = ("probe", "prefill", "decode", "offload")
HUB = "tcp://gateway:5556"
# libgomp1, libblas3 and liblapack3: FAISS (linked statically) runs on OpenMP and BLAS/LAPACK.
RUNTIME_PACKAGES = ("libzmq5", "libsodium23", "libpcre2-8-0", "libutf8proc2", "libsimdjson14", "libmimalloc2.0",
                    "libxxhash0", "libcpp-httplib0.11", "librocksdb7.8", "libgomp1", "libblas3",
                    "liblapack3", "curl")


def check(name, condition, detail=""):
    print(("ok    " if condition else "FAIL  ") + name + (f": {detail}" if detail and not condition else ""))
    if not condition:
        failures.append(name)


def command_words(service):
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else [str(w) for w in command]


def flag(words, name):
    return words[words.index(name) + 1] if name in words[:-1] else None


def publishes(port, target):
    # compose prints the short syntax ("127.0.0.1:5555:5555/tcp") or the long one (a mapping).
    if isinstance(port, dict):
        return int(port.get("target", 0)) == target and "published" in port
    return re.search(rf":{target}(/tcp)?$", str(port)) is not None and str(port).count(":") >= 1


def depends_on(service):
    value = service.get("depends_on", [])
    return list(value) if isinstance(value, (list, dict)) else []


def check_compose(repo, docker_compose):
    # A clean environment: the defaults are what is under test, not the caller's overrides.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOELINE_", "COMPOSE_"))}
    run = subprocess.run([docker_compose, "-f", os.path.join(repo, "docker-compose.yml"), "config"],
                         capture_output=True, text=True, cwd=repo, env=env, timeout=120)
    check("docker-compose config accepts the file", run.returncode == 0, run.stderr.strip())
    if run.returncode != 0:
        return
    services = yaml.safe_load(run.stdout).get("services", {})
    check("one service per stage, and the one-shot keys service",
          sorted(services) == sorted(STAGES + ("keys",)), f"{sorted(services)}")
    keys = services.get("keys", {})
    keys_dir = flag(command_words(keys), "--dir")
    check("keys: runs `moeline keys init` into a volume",
          command_words(keys)[:3] == ["moeline", "keys", "init"] and bool(keys_dir) and
          any(str(v.get("target") if isinstance(v, dict) else v).find(keys_dir or "?") >= 0
              for v in keys.get("volumes", [])), f"{command_words(keys)}")
    check("keys: runs once (no restart)", str(keys.get("restart", "no")) == "no")
    for name in STAGES:
        service = services.get(name)
        if service is None:
            continue
        words = command_words(service)
        check(f"{name}: runs `moeline {name}`", words[:2] == ["moeline", name], f"{words}")
        check(f"{name}: has a --model", bool(flag(words, "--model")), f"{words}")
        check(f"{name}: runs CurveZMQ with the keys service's directory (--curve-dir)",
              flag(words, "--curve-dir") == keys_dir and "keys" in depends_on(service), f"{words}")
        check(f"{name}: serves /healthz and /metrics on 0.0.0.0:9100",
              flag(words, "--http") == "0.0.0.0:9100", f"{words}")
        test = service.get("healthcheck", {}).get("test", [])
        test = " ".join(test) if isinstance(test, list) else str(test)
        check(f"{name}: health check curls /readyz on the --http port",
              "curl" in test and "http://127.0.0.1:9100/readyz" in test, test)
        check(f"{name}: restart policy", service.get("restart") in ("unless-stopped", "on-failure", "always"),
              f"{service.get('restart')}")
        check(f"{name}: has an image to run (built from docker/Dockerfile)",
              bool(service.get("image")) and
              service.get("build", {}).get("dockerfile", "").endswith("docker/Dockerfile"))
    for name in SCALABLE:
        service = services.get(name, {})
        check(f"{name}: scalable (no container_name, no host ports)",
              "container_name" not in service and not service.get("ports"),
              f"container_name={service.get('container_name')} ports={service.get('ports')}")
    for name in WORKERS:
        service = services.get(name, {})
        check(f"{name}: connects to the gateway's hub {HUB}", flag(command_words(service), "--hub") == HUB,
              f"{command_words(service)}")
        check(f"{name}: starts once the gateway is healthy",
              service.get("depends_on", {}).get("gateway", {}).get("condition") ==
              "service_healthy", f"{service.get('depends_on')}")
        if name in ("prefill", "decode"):
            check(f"{name}: starts once the offload manager (the node's expert pool) is healthy",
                  service.get("depends_on", {}).get("offload", {}).get("condition") ==
                  "service_healthy", f"{service.get('depends_on')}")
    gateway = services.get("gateway", {})
    words = command_words(gateway)
    check("gateway: binds the client endpoint and the hub on all interfaces",
          flag(words, "--client-bind") == "tcp://*:5555" and flag(words, "--hub-bind") == "tcp://*:5556",
          f"{words}")
    ports = gateway.get("ports", [])
    check("gateway: publishes the client port 5555 to the host",
          any(publishes(p, 5555) for p in ports), f"{ports}")
    front = services.get("http", {})
    words = command_words(front)
    check("http: a client of the gateway's client endpoint, listening on 0.0.0.0:8000",
          flag(words, "--gateway") == "tcp://gateway:5555" and flag(words, "--listen") == "0.0.0.0:8000"
          and "gateway" in depends_on(front), f"{words}")
    ports = front.get("ports", [])
    check("http: publishes 8000 from a host port range (replicas scale without colliding)",
          any(publishes(p, 8000) and ("-" in str(p) or "-" in str(p.get("published", "")
                                                                    if isinstance(p, dict) else ""))
              for p in ports), f"{ports}")


def check_dockerfile(repo):
    path = os.path.join(repo, "docker", "Dockerfile")
    text = open(path).read()
    stages = re.findall(r"^FROM\s+(\S+)", text, re.MULTILINE)
    check("Dockerfile: builds on debian:12, runs on debian:12-slim",
          len(stages) >= 2 and stages[0] == "debian:12" and stages[-1] == "debian:12-slim", f"{stages}")
    runtime = text[text.rindex("\nFROM"):]
    missing = [p for p in RUNTIME_PACKAGES if not re.search(rf"(^|\s){re.escape(p)}(\s|$)", runtime)]
    check("Dockerfile: the runtime stage installs the runtime libraries and curl", not missing,
          f"missing {missing}")
    check("Dockerfile: builds the moeline target without tests or benchmarks",
          "--target moeline" in text and "-DMOELINE_TESTS=OFF" in text and "-DMOELINE_BENCH=OFF" in text)
    check("Dockerfile: copies the binary to /usr/local/bin",
          re.search(r"COPY --from=\S+ \S*build/stages/moeline /usr/local/bin/moeline", runtime) is not None)
    check("Dockerfile: copies the demo model to /models/demo-qwen3-moe",
          re.search(r"COPY models/demo-qwen3-moe /models/demo-qwen3-moe", runtime) is not None)
    # The GPU variant (--build-arg MOELINE_CUDA=ON): CUDA from Debian's non-free section in both
    # stages, nvcc with Debian's paired host compiler, cuBLAS at run time, OFF by default.
    check("Dockerfile: MOELINE_CUDA defaults to OFF", re.search(r"^ARG MOELINE_CUDA=OFF$", text, re.M) is not None)
    check("Dockerfile: both stages see MOELINE_CUDA",
          len(re.findall(r"^ARG MOELINE_CUDA$", text, re.M)) == 2)
    builder = text[:text.rindex("\nFROM")]
    check("Dockerfile: the GPU build installs nvcc and builds with the CUDA backend ON",
          "nvidia-cuda-toolkit" in builder and "-DMOELINE_CUDA=ON" in builder
          and "CMAKE_CUDA_HOST_COMPILER=/usr/bin/cuda-g++" in builder)
    check("Dockerfile: the GPU image installs cuBLAS and enables non-free in both stages",
          "libcublas11" in runtime and builder.count("non-free") >= 1 and runtime.count("non-free") >= 1)
    cuda_overlay = open(os.path.join(repo, "deploy", "k8s", "overlays", "cuda", "kustomization.yaml")).read()
    check("Dockerfile: the image the cuda overlay runs is the one documented (moeline-cuda)",
          "newName: moeline-cuda" in cuda_overlay and "-t moeline-cuda" in text)
    ignore = open(os.path.join(repo, ".dockerignore")).read().split()
    check(".dockerignore: keeps build output, node_modules, generated models and .git out",
          all(p in ignore for p in ("build*", "tests/parity/node_modules", "models/generated", ".git")),
          f"{ignore}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", required=True)
    parser.add_argument("--docker-compose", default="docker-compose")
    args = parser.parse_args()
    check_compose(args.repo, args.docker_compose)
    check_dockerfile(args.repo)
    print(f"\n{'FAILED: ' + ', '.join(failures) if failures else 'all deployment checks passed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
