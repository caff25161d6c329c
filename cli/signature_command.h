#pragma once
// `moeline signature`: activation signatures of prompts (the approximate-reuse probe's function),
// for evaluating how well router similarity tells interchangeable prompts from different ones.
namespace moeline::cli {
int signature_command(int argc, char** argv);
}
