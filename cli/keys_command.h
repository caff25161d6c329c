#pragma once
// `moeline keys`: the stack's Curve key directory (init, rotate, prune) and the gateway's API keys
// file (add, list, remove). See docs/SECURITY.md.

namespace moeline::cli {

int keys_command(int argc, char** argv);

}  // namespace moeline::cli
