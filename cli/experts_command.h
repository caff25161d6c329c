#pragma once
// `moeline experts`: the router health of a running stack as a per-layer heat map (terminal and
// PNG), and `moeline experts replay`: an expert access trace against cache policies and Belady's
// bound.
namespace moeline::cli {
int experts_command(int argc, char** argv);
}
