#pragma once
// `moeline prefill`: takes PrefillJobs from the hub, prefills them in batches (as many queued
// prompts as fit the token budget, in one forward pass), samples each first token, and answers
// PrefillDone with the prompt's KV blocks as one bulk frame, for a decode replica to continue.
namespace moeline::stages {
int prefill_main(int argc, char** argv);
}
