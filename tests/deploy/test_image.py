#!/usr/bin/python3
"""The image and the compose stack, built and run where a Docker daemon is reachable (ctest
`deploy_image`; it skips with exit 77 where there is none, as on the development VM):

- `docker build -f docker/Dockerfile` builds the CPU image;
- the image's `moeline run` on its embedded demo model gives the same greedy ids as this build's;
- `docker-compose up` (the repository's compose file, that image, ports picked free) comes up
  healthy (every service's health check on /readyz), and a request through the gateway's client
  endpoint over tcp:// with CurveZMQ (the stack's own gateway.pub) gives the same ids again;
- `docker-compose down` stops it (SIGTERM, drain).

The static checks of the same files (no daemon) are tests/deploy/test_compose.py.

    test_image.py --repo REPO --moeline BIN --workdir DIR [--docker docker] [--docker-compose docker-compose]
"""
import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time

failures = []
PROMPT = "1,2,3,4,5,6,7,8"
MAX_TOKENS = "8"


def check(name, condition, detail=""):
    print(("ok    " if condition else "FAIL  ") + name + (f": {detail}" if detail and not condition else ""))
    if not condition:
        failures.append(name)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ids_of_run(stdout):
    """`moeline run --tokens` prints the generated ids."""
    return [int(x) for x in re.findall(r"-?\d+", stdout)]


def daemon_reachable(docker):
    try:
        return subprocess.run([docker, "info"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", required=True)
    ap.add_argument("--moeline", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--docker", default="docker")
    ap.add_argument("--docker-compose", default="docker-compose")
    args = ap.parse_args()
    if not daemon_reachable(args.docker):
        print("skip: no Docker daemon is reachable (`docker info` fails); "
              "tests/deploy/test_compose.py checks the files without one")
        return 77
    os.makedirs(args.workdir, exist_ok=True)
    tag = f"moeline-ci-test:{os.getpid()}"
    build = subprocess.run([args.docker, "build", "-f", "docker/Dockerfile", "-t", tag, "."],
                           cwd=args.repo, capture_output=True, text=True, timeout=5400)
    check("docker build of docker/Dockerfile", build.returncode == 0,
          (build.stdout + build.stderr)[-3000:])
    if build.returncode != 0:
        return 1
    try:
        reference = subprocess.run(
            [args.moeline, "run", "--model", os.path.join(args.repo, "models", "demo-qwen3-moe"),
             "--tokens", PROMPT, "--max-tokens", MAX_TOKENS],
            capture_output=True, text=True, timeout=300)
        check("this build's moeline run", reference.returncode == 0, reference.stderr[-800:])
        expected = ids_of_run(reference.stdout)
        inside = subprocess.run(
            [args.docker, "run", "--rm", tag, "moeline", "run", "--model", "/models/demo-qwen3-moe",
             "--tokens", PROMPT, "--max-tokens", MAX_TOKENS],
            capture_output=True, text=True, timeout=600)
        check("the image's moeline run gives this build's ids",
              inside.returncode == 0 and ids_of_run(inside.stdout) == expected,
              f"{inside.stdout.strip()} vs {expected}; {inside.stderr[-800:]}")
        check_compose(args, tag, expected)
    finally:
        subprocess.run([args.docker, "image", "rm", "-f", tag], capture_output=True, timeout=300)
    print(f"{len(failures)} failure(s)")
    return 1 if failures else 0


def check_compose(args, tag, expected):
    client_port, metrics_port = free_port(), free_port()
    http_port = free_port()
    env = dict(os.environ, MOELINE_IMAGE=tag, COMPOSE_PROJECT_NAME=f"moelineci{os.getpid()}",
               MOELINE_CLIENT_PORT=str(client_port), MOELINE_METRICS_PORT=str(metrics_port),
               MOELINE_HTTP_PORTS=f"{http_port}-{http_port}", MOELINE_SHM_SIZE="1g")
    compose = [args.docker_compose, "-f", os.path.join(args.repo, "docker-compose.yml")]

    def run(*words, timeout=600):
        return subprocess.run([*compose, *words], cwd=args.repo, env=env, capture_output=True,
                              text=True, timeout=timeout)

    up = run("up", "-d", "--no-build", timeout=900)
    try:
        check("docker-compose up", up.returncode == 0, (up.stdout + up.stderr)[-2000:])
        if up.returncode != 0:
            return
        healthy, states = False, ""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            ids = run("ps", "-q").stdout.split()
            inspect = subprocess.run(
                [args.docker, "inspect", "--format",
                 "{{.Name}} {{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}",
                 *ids], capture_output=True, text=True, timeout=60)
            lines = [line.split() for line in inspect.stdout.splitlines() if line.strip()]
            states = inspect.stdout
            # Every long-running service healthy; the one-shot keys service has exited.
            services = [line for line in lines if len(line) >= 3]
            if services and all(line[2] == "healthy" for line in services):
                healthy = True
                break
            time.sleep(3)
        check("every service becomes healthy (/readyz)", healthy, states)
        if not healthy:
            print(run("logs", "--tail", "40").stdout[-4000:])
            return
        server_key = os.path.join(args.workdir, "gateway.pub")
        key = run("run", "--rm", "--no-deps", "keys", "cat", "/var/lib/moeline/keys/gateway.pub")
        with open(server_key, "w") as f:
            f.write(key.stdout)
        generated = subprocess.run(
            [args.moeline, "client", "generate", "--endpoint", f"tcp://127.0.0.1:{client_port}",
             "--server-key", server_key, "--tokens", PROMPT, "--max-tokens", MAX_TOKENS,
             "--ignore-eos", "--json"], capture_output=True, text=True, timeout=300)
        result = json.loads(generated.stdout) if generated.returncode == 0 else {}
        got = result.get("ids")
        # `moeline run` stops at end-of-sequence; the stack was told to ignore it, so compare the
        # common prefix's length equal to run's output.
        check("a request through the compose stack (tcp://, Curve) gives moeline run's ids",
              got is not None and got[:len(expected)] == expected,
              f"{got} vs {expected}; {generated.stderr[-800:]}")
    finally:
        down = run("down", "-v", "--timeout", "60", timeout=900)
        check("docker-compose down", down.returncode == 0, (down.stdout + down.stderr)[-2000:])


if __name__ == "__main__":
    sys.exit(main())
