#!/usr/bin/env python3
"""Every message type, every field at its extremes, at every stage's socket: no handler may let
anything escape into its stage loop.

The messages are generated from schemas/*.fbs (parsed here, so a field added to the schema is
covered without touching this test): for each table, one message per field and extreme value (the
other fields absent), and one with every field at an extreme; integers at their type's minimum and
maximum (enums past their last value), floats NaN and infinite, strings empty and 100 KB long,
vectors empty and thousands long, nested tables with all their fields at extremes, and — for
messages that describe bulk frames — with and without a stray bulk frame.

Cases (--case, one per CTest entry):
  gateway  a stack; every type to the client endpoint, then from four rogue peers accepted on the
           hub as each stage kind (an open ipc:// stack lets them join). Afterwards every stage has
           its pid, and a request is served identically to `moeline run`.
  stages   probe, prefill, decode and offload manager, each started against a hub this test plays:
           after every type at its extremes, each process is alive and its loop still turning.
"""

import math
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from peer_frames import dealer, hello, settings_hash  # noqa: E402
from stack_harness import Stack, reference, run_cases  # noqa: E402

SCALARS = {  # FlatBuffers type -> (Builder method suffix, bytes, minimum, maximum)
    "bool": ("Bool", 1, 0, 1), "byte": ("Int8", 1, -2**7, 2**7 - 1),
    "ubyte": ("Uint8", 1, 0, 2**8 - 1), "short": ("Int16", 2, -2**15, 2**15 - 1),
    "ushort": ("Uint16", 2, 0, 2**16 - 1), "int": ("Int32", 4, -2**31, 2**31 - 1),
    "uint": ("Uint32", 4, 0, 2**32 - 1), "long": ("Int64", 8, -2**63, 2**63 - 1),
    "ulong": ("Uint64", 8, 0, 2**64 - 1), "float": ("Float32", 4, None, None),
    "double": ("Float64", 8, None, None),
}
FLOATS = [math.nan, math.inf, -math.inf, -1.0, 3.0e38]
# Messages that a receiver acts on, so that one field at an extreme reaches past the first check
# (a request with max_tokens 2^63-1 and a real prompt went all the way to decode and crashed it).
SAMPLING = {"max_tokens": 4}
BASELINES = {
    "GenerateRequest": {"client_request_id": 77, "tokens": [5, 6, 7], "sampling": SAMPLING},
    "ControlCommand": {"command": "status"},
    "Feedback": {"client_request_id": 77, "score": 0.5},
    "CancelRequest": {"client_request_id": 77},
    "ProbeJob": {"request_id": 1, "attempt": 1, "tokens": [5, 6, 7], "cache_namespace": "tenant:x",
                 "sampling": SAMPLING, "allowed_levels": 7},
    "PrefillJob": {"request_id": 1, "attempt": 1, "tokens": [5, 6, 7], "sampling": SAMPLING,
                   "cache_namespace": "tenant:x", "store_levels": 3},
    "CancelJob": {"request_id": 1, "attempt": 1},
}


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def parse_schemas(folder):
    """{table: (identifier, [(field, type, id)])}, {enum: underlying scalar type},
    {struct: [(field, scalar type)]}."""
    tables, enums, structs = {}, {}, {}
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".fbs"):
            continue
        with open(os.path.join(folder, name)) as f:
            text = re.sub(r"//[^\n]*", "", f.read())
        identifier = re.search(r'file_identifier\s+"(\w{4})"', text)
        for kind, table, base, body in re.findall(
                r"(table|enum)\s+(\w+)\s*(?::\s*(\w+))?\s*\{([^}]*)\}", text):
            if kind == "enum":
                enums[table] = base
                continue
            fields = [(field, ftype, int(fid)) for field, ftype, fid in re.findall(
                r"(\w+)\s*:\s*(\[?\w+\]?)[^;(]*\(\s*id:\s*(\d+)[^)]*\)\s*;", body)]
            tables[table] = (identifier.group(1).encode() if identifier else b"", fields)
        for struct, body in re.findall(r"struct\s+(\w+)\s*\{([^}]*)\}", text):
            structs[struct] = re.findall(r"(\w+)\s*:\s*(\w+)\s*;", body)
    return tables, enums, structs


class Generator:
    def __init__(self, tables, enums, structs):
        self.tables, self.enums, self.structs = tables, enums, structs

    def scalar(self, ftype):
        return SCALARS[self.enums.get(ftype, ftype)]

    def struct_layout(self, name):
        """(size, alignment) of a struct of scalars laid out without padding (as they are here)."""
        offset, align = 0, 1
        for _, ftype in self.structs[name]:
            size = self.scalar(ftype)[1]
            if offset % size:
                raise ValueError(f"struct {name}: padding is not supported here")
            offset, align = offset + size, max(align, size)
        return offset, align

    def struct_extremes(self, name):
        """Tuples of a struct's fields: each field at each of its extremes, the others 0."""
        fields = self.structs[name]
        out = []
        for i, (_, ftype) in enumerate(fields):
            for value in self.extremes(ftype):
                out.append(tuple(value if j == i else 0 for j in range(len(fields))))
        return out

    def extremes(self, ftype, depth=0):
        if ftype.startswith("["):
            inner = ftype[1:-1]
            if inner in self.structs:
                elements = self.struct_extremes(inner)
                return [[], [elements[-1]] * 5000, elements]
            if inner in self.tables:
                element = self.extremes(inner, depth + 1)
                if not element:
                    return [[]]  # nested too deep to fill: only the empty vector
                return [[], [element[0]] * (200 if depth == 0 else 3)]
            if inner == "string":
                return [[], ["x" * 1000] * 100]
            values = self.extremes(inner, depth + 1)
            return [[], [values[-1]] * 5000, values]
        if ftype == "string":
            return ["", "x" * 100_000, "\u00e9\u2603\x00tail"]
        if ftype in self.tables:
            return [("all", depth)] if depth < 3 else []
        suffix, _, low, high = self.scalar(ftype)
        if low is None:
            return list(FLOATS)
        values = [low, high] if suffix != "Bool" else [True]
        if low < 0:
            values.append(-1)
        return values

    def build(self, builder, ftype, value):
        """Offset of a non-scalar value (string, vector, table), built before its parent."""
        if ftype == "string":
            return builder.CreateString(value)
        if ftype.startswith("["):
            inner = ftype[1:-1]
            if inner in self.structs:
                size, align = self.struct_layout(inner)
                builder.StartVector(size, len(value), align)
                for element in reversed(value):
                    builder.Prep(align, size)
                    for (_, ftype), v in reversed(list(zip(self.structs[inner], element))):
                        getattr(builder, "Prepend" + self.scalar(ftype)[0])(v)
                return builder.EndVector()
            if inner in self.tables or inner == "string":
                offsets = [self.build(builder, inner, v) for v in value]
                builder.StartVector(4, len(offsets), 4)
                for offset in reversed(offsets):
                    builder.PrependUOffsetTRelative(offset)
                return builder.EndVector()
            suffix, size, _, _ = self.scalar(inner)
            builder.StartVector(size, len(value), size)
            for v in reversed(value):
                getattr(builder, "Prepend" + suffix)(v)
            return builder.EndVector()
        if isinstance(value, dict):
            return self.table(builder, ftype, value)
        _, depth = value
        return self.table(builder, ftype, {f: self.extremes(t, depth + 1)[0] for f, t, _ in
                                           self.tables[ftype][1] if self.extremes(t, depth + 1)})

    def table(self, builder, name, values):
        fields = self.tables[name][1]
        offsets = {f: self.build(builder, t, values[f]) for f, t, _ in fields
                   if f in values and not self.is_scalar(t)}
        builder.StartObject(max([i for _, _, i in fields], default=-1) + 1)
        for field, ftype, fid in fields:
            if field not in values:
                continue
            if field in offsets:
                builder.PrependUOffsetTRelativeSlot(fid, offsets[field], 0)
            else:
                suffix = self.scalar(ftype)[0]
                getattr(builder, f"Prepend{suffix}Slot")(fid, values[field], None)
        return builder.EndObject()

    def is_scalar(self, ftype):
        return ftype in SCALARS or ftype in self.enums

    def variants(self, name):
        """Dicts of field values: the baseline (empty, or a message its receiver acts on) with one
        field at a time at each extreme (in a nested table: one of its fields at a time), then
        every field at an extreme at once."""
        fields = self.tables[name][1]
        base = BASELINES.get(name, {})
        out = [{}, dict(base)]
        for field, ftype, _ in fields:
            for value in self.extremes(ftype):
                out.append({**base, field: value})
            if ftype in self.tables:
                nested = base.get(field, {}) if isinstance(base.get(field), dict) else {}
                for sub_field, sub_type, _ in self.tables[ftype][1]:
                    for value in self.extremes(sub_type, 1):
                        out.append({**base, field: {**nested, sub_field: value}})
        out.append({f: self.extremes(t)[-1] for f, t, _ in fields if self.extremes(t)})
        # Requests in flight at once need ids of their own (a repeated id is refused up front).
        for number, values in enumerate(out):
            if values.get("client_request_id") == 77:
                values["client_request_id"] = 1000 + number
        return out

    def messages(self, name):
        """Every variant of table `name`, framed as a moeline message (some with a bulk frame)."""
        import flatbuffers
        from moeline_client import encode_message
        from moeline.wire import MessageType
        message_type = getattr(MessageType.MessageType, name)
        identifier = self.tables[name][0]
        has_frames = any(f == "frames" for f, _, _ in self.tables[name][1])
        for values in self.variants(name):
            builder = flatbuffers.Builder(1024)
            builder.ForceDefaults(True)
            root = self.table(builder, name, values)
            builder.Finish(root, file_identifier=identifier)
            frames = encode_message(message_type, builder.Output())
            yield frames
            if has_frames:
                yield frames + [b"\x07" * 64]


def message_types():
    from moeline.wire import MessageType
    return sorted((v, k) for k, v in vars(MessageType.MessageType).items()
                  if not k.startswith("_"))


def flood(sock, generator, label):
    sent = 0
    for _, name in message_types():
        for frames in generator.messages(name):
            sock.send_multipart(frames)
            sent += 1
            if sent % 200 == 0:
                time.sleep(0.05)  # let the receiver keep up; nothing here is about throughput
    print(f"ok extremes: {sent} messages of {len(message_types())} types sent to {label}")
    return sent


def case_gateway(args):
    from moeline_client import Client
    from moeline.wire import StageKind
    generator = Generator(*parse_schemas(os.path.join(ROOT, "schemas")))
    run = os.path.join(args.workdir, "gateway")
    with Stack(args.moeline, args.model, run) as stack:
        before = {s["name"]: s["pid"] for s in stack.state()["stages"]}
        client = dealer(stack.endpoint, b"extreme-client")
        flood(client, generator, "the client endpoint")
        hub = stack.state()["hub"]
        for kind in ("Probe", "Prefill", "Decode", "OffloadManager"):
            rogue = dealer(hub, f"extreme-{kind}".encode())
            rogue.send_multipart(hello(getattr(StageKind.StageKind, kind), settings_hash(stack),
                                       replica=f"extreme-{kind}"))
            time.sleep(0.2)
            flood(rogue, generator, f"the hub, as an accepted {kind} peer")
            rogue.close()
        client.close()
        time.sleep(1)
        after = {s["name"]: s["pid"] for s in stack.state()["stages"]}
        restarts = {s["name"]: s["restarts"] for s in stack.state()["stages"]}
        check(after == before and not any(restarts.values()),
              f"a stage died: {before} -> {after}, restarts {restarts}")
        expected = reference(args.moeline, args.model, 8, tokens=[4, 5, 6])
        with Client(stack.endpoint, timeout=60) as c:
            got = c.generate(tokens=[4, 5, 6], max_tokens=8).ids
        check(got == expected["ids"], f"after the flood: {got} != {expected['ids']}")
        errors = stack.metric("gateway", "moeline_handler_errors_total",
                              created_on_first_event=True, stage="gateway", handler="client")
        print(f"ok extremes: every stage kept its pid; served identically to moeline run "
              f"(handler exceptions caught at the gateway: {errors:.0f})")


def case_stages(args):
    import zmq
    from moeline_client import decode_message, encode_message
    from moeline.wire import Hello, HelloReply, MessageType
    import flatbuffers
    generator = Generator(*parse_schemas(os.path.join(ROOT, "schemas")))
    work = os.path.join(args.workdir, "stages")
    os.makedirs(work, exist_ok=True)
    for stage in ("probe", "prefill", "decode", "offload"):
        endpoint = f"ipc://{work}/hub-{stage}.sock"
        router = zmq.Context.instance().socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.RCVTIMEO, 60000)
        router.bind(endpoint)
        port_file = os.path.join(work, f"{stage}.port")
        for stale in (port_file, port_file + ".alive"):
            if os.path.exists(stale):
                os.remove(stale)
        log = open(os.path.join(work, f"{stage}.log"), "w")
        cmd = [args.moeline, stage, "--model", args.model, "--hub", endpoint, "--http",
               "127.0.0.1:0", "--port-file", port_file, "--replica", f"x-{stage}"]
        if stage in ("prefill", "decode"):
            cmd += ["--threads", "1"]
        if stage == "probe":
            cmd += ["--store-path", os.path.join(work, "store")]
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            identity = None
            while identity is None:
                frames = router.recv_multipart()
                message = decode_message(frames[1:])
                if message.type == MessageType.MessageType.Hello:
                    identity = frames[0]
                    h = Hello.Hello.GetRootAs(message.body, 0)
                    b = flatbuffers.Builder(64)
                    HelloReply.Start(b)
                    HelloReply.AddAccepted(b, True)
                    HelloReply.AddSettingsHash(b, h.SettingsHash())
                    b.Finish(HelloReply.End(b), file_identifier=b"MLCM")
                    router.send_multipart(
                        [identity] + encode_message(MessageType.MessageType.HelloReply,
                                                    b.Output()))
            sent = 0
            for _, name in message_types():
                for frames in generator.messages(name):
                    router.send_multipart([identity] + frames)
                    sent += 1
                    if sent % 200 == 0:
                        time.sleep(0.05)
            time.sleep(2)
            check(process.poll() is None,
                  f"{stage} exited ({process.returncode}) under messages at their extremes")
            with open(port_file + ".alive") as f:
                import json
                state = json.load(f)
            check(state["loop_idle_ms"] < 5000, f"{stage}'s loop stopped turning: {state}")
            print(f"ok extremes: {stage} took {sent} messages at their extremes and is alive, its "
                  f"loop turning (idle {state['loop_idle_ms']} ms)")
        finally:
            process.terminate()
            try:
                process.wait(timeout=40)
            except subprocess.TimeoutExpired:
                process.kill()
            log.close()
            router.close()


CASES = {"gateway": case_gateway, "stages": case_stages}


def main():
    run_cases(CASES, __doc__)


if __name__ == "__main__":
    main()
