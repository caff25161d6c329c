// Generates from token ids with the installed C++ SDK and prints the result as JSON:
//   consumer ENDPOINT MAX_TOKENS ID,ID,...
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>

#include "sdk/client.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: consumer ENDPOINT MAX_TOKENS ID,ID,...\n";
    return 2;
  }
  moeline::sdk::GenerateOptions options;
  options.max_tokens = std::atoll(argv[2]);
  std::stringstream ids(argv[3]);
  for (std::string id; std::getline(ids, id, ',');) options.tokens.push_back(std::stoi(id));
  try {
    moeline::sdk::Client client(argv[1]);
    const moeline::sdk::Result result = client.generate(options);
    std::cout << "{\"ids\": [";
    for (size_t i = 0; i < result.ids.size(); ++i) std::cout << (i ? ", " : "") << result.ids[i];
    std::cout << "], \"finish_reason\": \"" << result.finish_reason << "\"}\n";
  } catch (const std::exception& e) {
    std::cerr << "consumer: " << e.what() << '\n';
    return 1;
  }
  return 0;
}
