#pragma once

namespace moeline::cli {

// `moeline run`: load a checkpoint, generate for one prompt in this process, print the ids.
int run_command(int argc, char** argv);

}  // namespace moeline::cli
