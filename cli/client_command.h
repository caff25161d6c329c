#pragma once
// `moeline client ...`: the command-line client, on top of the C++ SDK.
//   moeline client generate --endpoint EP (--prompt TEXT | --tokens 1,2,3) [options] [--json]
//   moeline client status --endpoint EP
namespace moeline::cli {
int client_command(int argc, char** argv);
}
