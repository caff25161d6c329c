#pragma once
// `moeline decode`: continuous batching. Sequences arrive as PrefillDone messages (the prompt's KV
// as a bulk frame), join the running batch at the next step boundary, and leave it when they stop;
// each step's new tokens go to the gateway as one TokenBatch. A sequence is admitted only when the
// KV blocks for its whole run (prompt + max_tokens, up to the context) are free, so a running
// sequence never runs out of cache; until then it waits in this replica's queue. Capacity is
// granted to the hub as credits, so when full the replica stops taking work instead of dropping it.
namespace moeline::stages {
int decode_main(int argc, char** argv);
}
