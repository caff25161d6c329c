"""A peer built by hand, for the attack tests: a raw DEALER socket and the stage frames a rogue
process would send (it needs only the wire schemas and what the gateway logs), so that tests can
say hello as any stage and then send what no real stage would."""

import os


def dealer(endpoint, identity=None, curve=None):
    """A DEALER connected to `endpoint`; `curve` is (server_key, public_key, secret_key)."""
    import zmq
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVTIMEO, 3000)
    # A send to a hub that refused the handshake must fail the test, not hang it.
    s.setsockopt(zmq.SNDTIMEO, 3000)
    if identity:
        s.setsockopt(zmq.ROUTING_ID, identity)
    if curve:
        server, public, secret = curve
        s.curve_serverkey, s.curve_publickey, s.curve_secretkey = server, public, secret
    s.connect(endpoint)
    return s


def gateway_logged(stack, name):
    """An integer field of the gateway's `listening` log line."""
    with open(os.path.join(stack.run_dir, "logs", "gateway.log")) as f:
        for line in f:
            if "event=listening" in line:
                for field in line.split():
                    if field.startswith(name + "="):
                        return int(field.split("=", 1)[1])
    raise AssertionError(f"the gateway did not log {name}")


def settings_hash(stack):
    """What a rogue peer on the same machine could compute from the model files; the gateway logs
    it (its refusals no longer hand it out)."""
    return gateway_logged(stack, "settings_hash")


def hello(stage_kind, hash_value, credits=0, replica="rogue"):
    import flatbuffers
    from moeline_client import encode_message
    from moeline.wire import Hello, MessageType
    b = flatbuffers.Builder(128)
    name = b.CreateString(replica)
    Hello.Start(b)
    Hello.AddStage(b, stage_kind)
    Hello.AddReplica(b, name)
    Hello.AddSchemaMajor(b, 1)
    Hello.AddSchemaMinor(b, 5)
    Hello.AddSettingsHash(b, hash_value)
    Hello.AddCredits(b, credits)
    b.Finish(Hello.End(b), file_identifier=b"MLCM")
    return encode_message(MessageType.MessageType.Hello, b.Output())
