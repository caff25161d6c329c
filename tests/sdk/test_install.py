#!/usr/bin/python3
"""Both SDKs installed the way users install them, then used against a real stack:

- Python: `pip install` of sdk/python into a fresh virtual environment (offline:
  --no-build-isolation --no-index, with Debian's setuptools, wheel, pyzmq and flatbuffers seen
  through --system-site-packages), from a copy of the sources (the build generates the wire code
  from the schemas with flatc); the package is typed (py.typed); the blocking Client and the
  asyncio AsyncClient (several requests at once on one connection, a stream left early) give
  what `moeline run` gives.
- C++: `cmake --install BUILD --component sdk` into a fresh prefix, then a project outside the
  tree (tests/sdk/consumer) configured with find_package(moeline), built and run.

  test_install.py --moeline BUILD/stages/moeline --build BUILD --model DIR --workdir DIR
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

USE_PYTHON_SDK = r'''
import asyncio, json, os, sys
import moeline_client
from moeline_client import Client
from moeline_client.aio import AsyncClient

endpoint, prompts = sys.argv[1], json.loads(sys.argv[2])
package = os.path.dirname(moeline_client.__file__)
out = {"py_typed": os.path.exists(os.path.join(package, "py.typed")), "location": package}
with Client(endpoint, timeout=60) as client:
    out["blocking"] = [client.generate(tokens=p, max_tokens=8).ids for p in prompts]

async def main():
    async with AsyncClient(endpoint, timeout=60) as client:
        results = await asyncio.gather(*(client.generate(tokens=p, max_tokens=8) for p in prompts))
        out["async"] = [r.ids for r in results]
        kinds = []
        async for event in client.stream(tokens=prompts[0], max_tokens=200, ignore_eos=True):
            kinds.append(event.kind)
            if event.kind == "delta":
                break  # leaving early cancels the request
        out["left_early"] = kinds
        out["after"] = (await client.generate(tokens=prompts[1], max_tokens=8)).ids
        out["status"] = sorted(await client.control("status"))

asyncio.run(main())
print(json.dumps(out))
'''


def fail(message):
    print(f"install: FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def check(condition, message):
    if not condition:
        fail(message)


def run(argv, **kwargs):
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600, **kwargs)
    check(out.returncode == 0, f"{' '.join(map(str, argv))}:\n{out.stdout[-1500:]}{out.stderr[-1500:]}")
    return out.stdout


def reference(args, tokens):
    out = run([args.moeline, "run", "--model", args.model, "--tokens", ",".join(map(str, tokens)),
               "--max-tokens", "8", "--json", "--threads", "1"])
    return json.loads(out)["ids"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moeline", required=True)
    ap.add_argument("--build", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11], [42, 17]]
    expected = [reference(args, p) for p in prompts]
    # A clean environment: nothing of the build or the source tree on the Python path.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    # Python: a copy of the sources (the in-tree build leaves files behind), into a fresh venv.
    src = os.path.join(args.workdir, "src")
    shutil.copytree(os.path.join(REPO, "sdk", "python"), os.path.join(src, "sdk", "python"),
                    ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    shutil.copytree(os.path.join(REPO, "schemas"), os.path.join(src, "schemas"))
    venv = os.path.join(args.workdir, "venv")
    run([sys.executable, "-m", "venv", "--system-site-packages", venv], env=env)
    python = os.path.join(venv, "bin", "python")
    run([python, "-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-index",
         os.path.join(src, "sdk", "python")], env=env)
    print("ok install: pip install sdk/python into a fresh virtual environment")

    # C++: install the SDK component, configure and build a consumer outside the tree.
    prefix = os.path.join(args.workdir, "prefix")
    run(["cmake", "--install", args.build, "--component", "sdk", "--prefix", prefix])
    consumer = os.path.join(args.workdir, "consumer")
    run(["cmake", "-S", os.path.join(HERE, "consumer"), "-B", consumer,
         f"-DCMAKE_PREFIX_PATH={prefix}", "-DCMAKE_BUILD_TYPE=Release"])
    run(["cmake", "--build", consumer])
    print("ok install: cmake --install --component sdk, find_package(moeline) in a project "
          "outside the tree, built")

    run_dir = os.path.join(args.workdir, "stack")
    endpoint = run([args.moeline, "stack", "up", "--model", args.model, "--run-dir", run_dir,
                    "--http-port", "off", "--threads", "1", "--timeout-s", "90"]).strip()
    endpoint = endpoint.splitlines()[-1]
    try:
        out = json.loads(run([python, "-c", USE_PYTHON_SDK, endpoint, json.dumps(prompts)],
                             env=env, cwd=args.workdir).strip().splitlines()[-1])
        check(out["location"].startswith(venv), f"moeline_client imported from {out['location']}")
        check(out["py_typed"], "the installed package has no py.typed")
        check(out["blocking"] == expected, f"blocking Client {out['blocking']} != {expected}")
        check(out["async"] == expected, f"AsyncClient {out['async']} != {expected}")
        check(out["left_early"][-1] == "delta" and out["after"] == expected[1],
              f"a stream left early: {out['left_early']}, the next request {out['after']}")
        check("reuse" in out["status"], f"control status: {out['status']}")
        print("ok install: the installed Python SDK, blocking and asyncio (3 requests at once, a "
              "stream left early, a control command), identical to `moeline run`")
        for tokens, want in zip(prompts, expected):
            got = json.loads(run([os.path.join(consumer, "consumer"), endpoint, "8",
                                  ",".join(map(str, tokens))]))
            check(got["ids"] == want, f"C++ consumer {got['ids']} != {want}")
        print("ok install: the installed C++ SDK's consumer identical to `moeline run`")
    finally:
        subprocess.run([args.moeline, "stack", "down", "--run-dir", run_dir], capture_output=True,
                       timeout=120)
    print("all ok")


if __name__ == "__main__":
    main()
