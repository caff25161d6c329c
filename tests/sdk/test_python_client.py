#!/usr/bin/python3
"""The Python SDK (sdk/python/moeline_client) against a scripted fake gateway: the bytes it sends
(envelope, file identifier, every GenerateRequest field read back with the generated accessors),
the stream it assembles, errors, cancel, feedback, control, multiplexing, timeouts with reconnect,
and replies it must refuse (wrong magic, wrong major). No moeline process is needed.

    test_python_client.py --repo REPO [--pygen BUILD/python] [--flatc flatc]

Without --pygen the FlatBuffers Python code is generated into a temporary folder with flatc.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import threading

failures = []


def check(name, condition, detail=""):
    print(("ok    " if condition else "FAIL  ") + name + (f": {detail}" if detail and not condition else ""))
    if not condition:
        failures.append(name)


def raises(fn, kind):
    try:
        fn()
    except kind as error:
        return error
    except Exception as error:  # the wrong exception is a failure, not a crash of the test
        return RuntimeError(f"expected {kind.__name__}, got {type(error).__name__}: {error}")
    return RuntimeError(f"expected {kind.__name__}, nothing raised")


class FakeGateway(threading.Thread):
    """A ROUTER that answers by prompt: enough of the gateway's contract to drive the SDK."""

    def __init__(self, endpoint, mc, wire):
        super().__init__(daemon=True)
        import zmq
        self.zmq, self.mc, self.wire = zmq, mc, wire
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.bind(endpoint)
        self.received = []  # (type, decoded table)
        self.held = {}      # crid -> identity, for requests that end only on cancel
        self.stopping = False

    def run(self):
        try:
            while not self.stopping:
                if not self.socket.poll(50):
                    continue
                identity, *frames = self.socket.recv_multipart()
                message = self.mc.decode_message(frames)
                self.handle(identity, message)
        except Exception as error:  # a broken fake would otherwise look like client timeouts
            check("fake gateway runs", False, f"{type(error).__name__}: {error}")
        finally:
            self.socket.close(linger=0)

    def send(self, identity, frames):
        self.socket.send_multipart([identity, *frames])

    def event(self, identity, crid, kind, **fields):
        import flatbuffers
        b = flatbuffers.Builder(256)
        b.Finish(self.build_event(b, crid, kind, **fields), file_identifier=b"MLCL")
        self.send(identity, self.mc.encode_message(self.mc.MessageType.StreamEvent, b.Output()))

    def batch(self, identity, events):
        """Several events, (crid, kind, fields) each, in one StreamEventBatch (schema 1.11)."""
        import flatbuffers
        B = self.wire.StreamEventBatch
        b = flatbuffers.Builder(1024)
        offsets = [self.build_event(b, crid, kind, **fields) for crid, kind, fields in events]
        B.StartEventsVector(b, len(offsets))
        for offset in reversed(offsets):
            b.PrependUOffsetTRelative(offset)
        vector = b.EndVector()
        B.Start(b)
        B.AddEvents(b, vector)
        b.Finish(B.End(b), file_identifier=b"MLCL")
        self.send(identity, self.mc.encode_message(self.mc.MessageType.StreamEventBatch, b.Output()))

    def build_event(self, b, crid, kind, **fields):
        w = self.wire
        text = b.CreateString(fields["text"]) if "text" in fields else None
        reason = b.CreateString(fields["finish_reason"]) if "finish_reason" in fields else None
        error_message = b.CreateString(fields["error_message"]) if "error_message" in fields else None
        ids = None
        if "token_ids" in fields:
            b.StartVector(4, len(fields["token_ids"]), 4)
            for t in reversed(fields["token_ids"]):
                b.PrependInt32(t)
            ids = b.EndVector()
        usage = timings = None
        typed = fields.get("typed", False)  # a 1.9 gateway's typed values, without the strings
        if kind == w.EventKind.EventKind.Finished:
            level = None if typed else b.CreateString("prefix")
            w.Usage.Start(b)
            w.Usage.AddPromptTokens(b, 5)
            w.Usage.AddCompletionTokens(b, 3)
            w.Usage.AddReusedTokens(b, 2)
            if typed:
                w.Usage.AddLevel(b, w.ReuseLevel.ReuseLevel.Full)
                w.Usage.AddOutcome(b, w.ApproximateOutcome.ApproximateOutcome.NoCandidate)
            else:
                w.Usage.AddReuseLevel(b, level)
            usage = w.Usage.End(b)
            w.Timings.Start(b)
            w.Timings.AddQueueMs(b, 1.5)
            w.Timings.AddPrefillMs(b, 2.5)
            w.Timings.AddTtftMs(b, 3.5)
            w.Timings.AddTotalMs(b, 9.0)
            timings = w.Timings.End(b)
        S = w.StreamEvent
        S.Start(b)
        S.AddClientRequestId(b, crid)
        S.AddRequestId(b, 1000 + crid)
        S.AddKind(b, kind)
        for offset, add in ((text, S.AddText), (ids, S.AddTokenIds), (reason, S.AddFinishReason),
                            (usage, S.AddUsage), (timings, S.AddTimings),
                            (error_message, S.AddErrorMessage)):
            if offset is not None:
                add(b, offset)
        if "error_code" in fields:
            S.AddErrorCode(b, fields["error_code"])
        if typed and kind == w.EventKind.EventKind.Finished:
            S.AddFinish(b, w.FinishReason.FinishReason.Stop)
        return S.End(b)

    def error_reply(self, identity, crid, code, text):
        import flatbuffers
        b = flatbuffers.Builder(64)
        message = b.CreateString(text)
        self.wire.ErrorReply.Start(b)
        self.wire.ErrorReply.AddCode(b, code)
        self.wire.ErrorReply.AddMessage(b, message)
        self.wire.ErrorReply.AddClientRequestId(b, crid)
        b.Finish(self.wire.ErrorReply.End(b), file_identifier=b"MLCM")
        self.send(identity, self.mc.encode_message(self.mc.MessageType.ErrorReply, b.Output()))

    def handle(self, identity, message):
        w, T, K = self.wire, self.mc.MessageType, self.wire.EventKind.EventKind
        if message.type == T.GenerateRequest:
            r = w.GenerateRequest.GenerateRequest.GetRootAs(message.body, 0)
            self.received.append((message, r))
            crid = r.ClientRequestId()
            prompt = (r.Prompt() or b"").decode()
            if prompt == "slow" or not r.TokensIsNone():
                self.event(identity, crid, K.Accepted)
                self.held[crid] = identity
            elif prompt == "fail":
                self.event(identity, crid, K.Accepted)
                self.event(identity, crid, K.Error, error_code=w.ErrorCode.ErrorCode.InvalidSampling,
                           error_message="top_p must be in (0, 1]")
            elif prompt == "refuse":
                self.error_reply(identity, 0, w.ErrorCode.ErrorCode.MalformedMessage, "bad body")
            elif prompt == "silent":
                pass
            elif prompt == "batched":
                # One decode step of every stream of this connection: the held requests' last
                # token and end, interleaved with this one's.
                self.event(identity, crid, K.Accepted)
                others = [held for held, who in self.held.items() if who == identity]
                events = [(other, K.Delta, {"token_ids": [7], "text": "x"}) for other in others]
                events.append((crid, K.Delta, {"token_ids": [1], "text": "a"}))
                for other in others:
                    events.append((other, K.Finished, {"finish_reason": "stop"}))
                    del self.held[other]
                events.append((crid, K.Finished, {"finish_reason": "length"}))
                self.batch(identity, events)
            elif prompt == "typed":
                self.event(identity, crid, K.Accepted)
                self.event(identity, crid, K.Delta, token_ids=[7], text="x")
                self.event(identity, crid, K.Finished, typed=True)
            elif prompt in ("bad magic", "bad major"):
                frames = self.mc.encode_message(T.StreamEvent, b"\0" * 16,
                                                major=2 if prompt == "bad major" else 1)
                if prompt == "bad magic":
                    frames[0] = b"HTTP" + frames[0][4:]
                self.send(identity, frames)
            else:
                self.event(identity, crid, K.Accepted)
                self.event(identity, crid, K.Delta, token_ids=[1, 2], text="ab")
                self.event(identity, crid, K.Delta, token_ids=[3], text="c\u00e9")
                self.event(identity, crid, K.Finished, finish_reason="length")
        elif message.type == T.CancelRequest:
            r = w.CancelRequest.CancelRequest.GetRootAs(message.body, 0)
            self.received.append((message, r))
            crid = r.ClientRequestId()
            if crid in self.held:
                self.event(self.held.pop(crid), crid, K.Finished, finish_reason="cancelled")
        elif message.type == T.Feedback:
            self.received.append((message, w.Feedback.Feedback.GetRootAs(message.body, 0)))
        elif message.type == T.ControlCommand:
            import flatbuffers
            r = w.ControlCommand.ControlCommand.GetRootAs(message.body, 0)
            self.received.append((message, r))
            command = r.Command().decode()
            b = flatbuffers.Builder(64)
            json_text = b.CreateString('{"stages": {"prefill": 3}}')
            text = b.CreateString("unknown command " + command)
            w.ControlReply.Start(b)
            w.ControlReply.AddOk(b, command == "status")
            w.ControlReply.AddJson(b, json_text) if command == "status" else w.ControlReply.AddMessage(b, text)
            b.Finish(w.ControlReply.End(b), file_identifier=b"MLCT")
            self.send(identity, self.mc.encode_message(T.ControlReply, b.Output()))

    def last(self, message_type):
        return [r for m, r in self.received if m.type == message_type][-1]


def load_modules(args):
    pygen = args.pygen
    if pygen is None:
        pygen = tempfile.mkdtemp(prefix="moeline-pygen-")
        schemas = sorted(os.path.join(args.repo, "schemas", f)
                         for f in os.listdir(os.path.join(args.repo, "schemas")) if f.endswith(".fbs"))
        subprocess.run([args.flatc, "--python", "--require-explicit-ids", "-o", pygen, *schemas],
                       check=True)
    sys.path[:0] = [pygen, os.path.join(args.repo, "sdk", "python")]
    import moeline_client as mc
    from moeline.wire import (ApproximateOutcome, CancelRequest, ControlCommand, ControlReply,
                              ErrorCode, ErrorReply, EventKind, Feedback, FinishReason,
                              GenerateRequest, ReuseLevel, StreamEvent, StreamEventBatch, Timings,
                              Usage)
    wire = argparse.Namespace(**{m.__name__.rsplit(".", 1)[1]: m for m in (
        StreamEventBatch, ApproximateOutcome, CancelRequest, ControlCommand, ControlReply, ErrorCode,
        ErrorReply,
        EventKind, Feedback, FinishReason, GenerateRequest, ReuseLevel, StreamEvent, Timings,
        Usage)})
    return mc, wire


def check_encoding(mc, wire):
    import struct
    frames = mc.encode_generate(7, "hi", max_tokens=33, temperature=0.5, top_k=4, top_p=0.9, seed=0,
                                stop_token_ids=[5, 6], ignore_eos=True, tenant="t1", deadline_ms=1500,
                                add_special_tokens=False)
    magic, major, minor, kind, flags, size = struct.unpack("<4sHHHHI", frames[0])
    check("header: magic, version 1.x, type, flags, body length",
          (magic, major, minor, kind, flags, size) ==
          (b"MOEL", 1, mc.SCHEMA_MINOR, mc.MessageType.GenerateRequest, 0, len(frames[1])))
    body = frames[1]
    check("body carries the client family identifier MLCL",
          wire.GenerateRequest.GenerateRequest.GenerateRequestBufferHasIdentifier(body, 0))
    r = wire.GenerateRequest.GenerateRequest.GetRootAs(body, 0)
    s = r.Sampling()
    got = (r.ClientRequestId(), r.Prompt(), r.TokensIsNone(), r.Tenant(), r.DeadlineMs(),
           r.AddSpecialTokens(), s.MaxTokens(), s.Temperature(), s.TopK(), abs(s.TopP() - 0.9) < 1e-12,
           s.Seed(), s.HasSeed(), [s.StopTokenIds(i) for i in range(s.StopTokenIdsLength())],
           s.IgnoreEos())
    want = (7, b"hi", True, b"t1", 1500, False, 33, 0.5, 4, True, 0, True, [5, 6], True)
    check("GenerateRequest fields read back with the generated accessors", got == want, f"{got}")
    r = wire.GenerateRequest.GenerateRequest.GetRootAs(mc.encode_generate(8, tokens=[9, 8, 7])[1], 0)
    s = r.Sampling()
    check("tokens request: ids, no prompt, defaults (no seed, top_p 1, max 16, specials on)",
          ([r.Tokens(i) for i in range(r.TokensLength())], r.Prompt(), s.HasSeed(), s.TopP(),
           s.MaxTokens(), r.AddSpecialTokens()) == ([9, 8, 7], None, False, 1.0, 16, True))
    check("skip_special_tokens: left at the schema's default (true) unless false is asked",
          (wire.GenerateRequest.GenerateRequest.GetRootAs(
              mc.encode_generate(9, "x", skip_special_tokens=False)[1], 0).SkipSpecialTokens(),
           r.SkipSpecialTokens()) == (False, True))
    check("min_tokens (schema 1.18): encoded where asked, 0 by default",
          (wire.GenerateRequest.GenerateRequest.GetRootAs(
              mc.encode_generate(9, "x", max_tokens=9, min_tokens=5)[1], 0).Sampling().MinTokens(),
           s.MinTokens()) == (5, 0))
    check("prompt and tokens together are refused",
          isinstance(raises(lambda: mc.encode_generate(1, "a", [1]), ValueError), ValueError))
    check("neither prompt nor tokens is refused",
          isinstance(raises(lambda: mc.encode_generate(1), ValueError), ValueError))
    m = mc.decode_message(frames)
    check("decode_message splits what encode_message framed",
          (m.type, m.minor, m.body, m.bulk) ==
          (mc.MessageType.GenerateRequest, mc.SCHEMA_MINOR, body, []))
    for name, bad, needle in (
            ("one frame", frames[:1], "header and a body"),
            ("short header", [frames[0][:15], body], "16"),
            ("wrong magic", [b"XXXX" + frames[0][4:], body], "magic"),
            ("wrong major", mc.encode_message(10, body, major=2, minor=0), "schema 2.0"),
            ("body length", [frames[0], body + b"\0"], "header says")):
        error = raises(lambda: mc.decode_message(bad), mc.ProtocolError)
        check(f"decode_message refuses {name}", isinstance(error, mc.ProtocolError) and needle in str(error),
              str(error))


def check_client(mc, wire, endpoint):
    gateway = FakeGateway(endpoint, mc, wire)
    gateway.start()
    T = mc.MessageType
    try:
        with mc.Client(endpoint, timeout=5.0) as client:
            result = client.generate("hello", max_tokens=3, seed=42, tenant="acme",
                                     reuse="approximate")
            check("generate: ids, text, finish reason, request id",
                  (result.ids, result.text, result.finish_reason, result.request_id,
                   result.client_request_id) == ([1, 2, 3], "abc\u00e9", "length", 1001, 1), f"{result}")
            check("generate: usage and timings dicts",
                  result.usage == {"prompt_tokens": 5, "completion_tokens": 3, "reused_tokens": 2,
                                   "reuse_level": "prefix", "approximate": "", "similarity": 0.0}
                  and result.timings["total_ms"] == 9.0,
                  f"{result.usage} {result.timings}")
            sent = gateway.last(T.GenerateRequest)
            check("the gateway read the request's tenant, seed, max_tokens and reuse",
                  (sent.Tenant(), sent.Sampling().Seed(), sent.Sampling().HasSeed(),
                   sent.Sampling().MaxTokens(), sent.Reuse()) == (b"acme", 42, True, 3,
                                                                  b"approximate"))
            typed = client.generate("typed")
            check("generate: a 1.9 gateway's typed finish reason, reuse level and outcome",
                  (typed.finish_reason, typed.usage["reuse_level"], typed.usage["approximate"])
                  == ("stop", "full", "no_candidate"), f"{typed}")

            kinds = [e.kind for e in client.stream("hello")]
            check("stream: accepted, deltas, then finished", kinds ==
                  ["accepted", "delta", "delta", "finished"], f"{kinds}")

            error = raises(lambda: client.generate("fail"), mc.GenerateError)
            check("an Error event raises GenerateError(code, message)",
                  isinstance(error, mc.GenerateError) and error.code == 3 and
                  error.code_name == "InvalidSampling" and "top_p" in error.message, str(error))
            error = raises(lambda: client.generate("refuse"), mc.GenerateError)
            check("an ErrorReply for the only request in flight ends it",
                  isinstance(error, mc.GenerateError) and error.code_name == "MalformedMessage", str(error))

            slow = client.start("slow")
            fast = client.start("hello")
            seen = []
            while not (seen and seen[-1].client_request_id == fast and seen[-1].terminal):
                seen.append(client.next_event())
            client.cancel(slow)
            last = client.next_event()
            check("multiplexed: the fast request finishes while the slow one waits",
                  [e.kind for e in seen if e.client_request_id == fast][-1] == "finished" and
                  all(e.client_request_id in (slow, fast) for e in seen))
            check("cancel: the stream ends with finish_reason cancelled",
                  (last.client_request_id, last.kind, last.finish_reason) == (slow, "finished", "cancelled"),
                  f"{last}")
            check("cancel sent the right id", gateway.last(T.CancelRequest).ClientRequestId() == slow)

            check("the client says it reads StreamEventBatch",
                  gateway.last(T.GenerateRequest).BatchEvents() is True)
            slow = client.start("slow")
            result = client.generate("batched")
            check("a StreamEventBatch: this request's events out of it, in order",
                  (result.ids, result.text, result.finish_reason) == ([1], "a", "length"),
                  f"{result}")
            rest = [client.next_event() for _ in range(3)]
            check("a StreamEventBatch: another request's events kept for next_event, in order",
                  [(e.client_request_id, e.kind, e.text) for e in rest] ==
                  [(slow, "accepted", ""), (slow, "delta", "x"), (slow, "finished", "")],
                  f"{rest}")

            stream = client.stream("slow")
            first = next(stream)
            stream.close()  # leaving early
            crid = first.client_request_id
            for _ in range(100):
                if any(m.type == T.CancelRequest and r.ClientRequestId() == crid for m, r in gateway.received):
                    break
                threading.Event().wait(0.02)
            check("leaving a stream early cancels its request",
                  gateway.last(T.CancelRequest).ClientRequestId() == crid)
            client.timeout = 0.3
            check("the abandoned request's late Finished is not handed out",
                  isinstance(raises(lambda: client.next_event(), TimeoutError), TimeoutError))
            client.timeout = 5.0

            client.feedback(1, 0.5, "good")
            status = client.control("status")
            fb = gateway.last(T.Feedback)
            check("feedback: id, score, comment reach the gateway",
                  (fb.ClientRequestId(), fb.Score(), fb.Comment()) == (1, 0.5, b"good"))
            check("control status returns the parsed JSON", status == {"stages": {"prefill": 3}}, f"{status}")
            error = raises(lambda: client.control("bogus"), mc.ControlError)
            check("a refused control command raises ControlError",
                  isinstance(error, mc.ControlError) and "unknown command" in str(error), str(error))
            check("bad input refused locally", isinstance(
                raises(lambda: client.feedback(1, 2.0), ValueError), ValueError))

            identity_before = client._socket
            client.timeout = 0.3
            error = raises(lambda: client.generate("silent"), TimeoutError)
            client.timeout = 5.0
            check("no reply within the timeout raises TimeoutError", isinstance(error, TimeoutError), str(error))
            check("a timeout recreates the socket", client._socket is not identity_before)
            check("the next call after a timeout works",
                  client.generate("hello").text == "abc\u00e9")

            error = raises(lambda: client.generate("bad magic"), mc.ProtocolError)
            check("a reply with wrong magic raises a clear ProtocolError",
                  isinstance(error, mc.ProtocolError) and "magic" in str(error), str(error))
            error = raises(lambda: client.generate("bad major"), mc.ProtocolError)
            check("a reply of another schema major raises a clear ProtocolError",
                  isinstance(error, mc.ProtocolError) and "schema 2" in str(error), str(error))
    finally:
        gateway.stopping = True
        gateway.join(5)


def check_curve_key_file(mc):
    """A key file whose path is exactly 40 characters, all in Z85's alphabet, is read as a file
    (taken for the key itself, the handshake would fail and the first request be lost)."""
    import json
    import zmq
    public, secret = zmq.curve_keypair()
    context = zmq.Context()
    server = context.socket(zmq.ROUTER)
    server.curve_server = True
    server.curve_secretkey = secret
    server.setsockopt(zmq.LINGER, 0)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    folder = tempfile.mkdtemp(prefix="k", dir="/tmp")
    path = os.path.join(folder, "g" * (40 - len(folder) - 5) + ".pub")
    check("the key file's path is 40 characters", len(path) == 40, path)
    with open(path, "w") as f:
        json.dump({"name": "gateway", "role": "gateway", "public": public.decode()}, f)
    try:
        with mc.Client(f"tcp://127.0.0.1:{port}", timeout=5.0, server_key=path) as client:
            client.start("over Curve")
            check("a 40-character key file path: the request arrives over Curve",
                  server.poll(5000) != 0)
        error = raises(lambda: mc.Client("tcp://127.0.0.1:1", server_key="~" * 40), ValueError)
        check("neither a key file nor a key: a clear error", isinstance(error, ValueError),
              str(error))
    finally:
        server.close()
        context.term()
        os.remove(path)
        os.rmdir(folder)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", required=True)
    parser.add_argument("--pygen", help="folder holding the generated moeline/wire package")
    parser.add_argument("--flatc", default="flatc")
    args = parser.parse_args()
    mc, wire = load_modules(args)
    check_encoding(mc, wire)
    # The SDK's reuse values are the wire contract's (schemas/wire.h kReuseModes).
    import re
    with open(os.path.join(args.repo, "schemas", "wire.h")) as f:
        declared = re.search(r"kReuseModes\[\] = \{([^}]*)\}", f.read())
    cpp_modes = tuple(re.findall(r'"([^"]*)"', declared.group(1))) if declared else ()
    check("reuse modes match the C++ list", mc.REUSE_MODES == cpp_modes,
          f"{mc.REUSE_MODES} vs {cpp_modes}")
    with tempfile.TemporaryDirectory(prefix="moeline-sdk-") as work:
        check_client(mc, wire, f"ipc://{work}/gateway.sock")
    check_curve_key_file(mc)
    print(f"\n{'FAILED: ' + ', '.join(failures) if failures else 'all Python SDK checks passed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
