#pragma once
// `moeline http`: the OpenAI-compatible HTTP front door. A client of the gateway (through the
// C++ SDK), so any number of HTTP replicas can front one gateway and scale on their own.
namespace moeline::stages {

int http_main(int argc, char** argv);

}  // namespace moeline::stages
