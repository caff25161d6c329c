#pragma once
// "Did you mean": the known name nearest to a mistyped one, for the errors about unknown options
// and settings that every command gives (an unknown flag is an error, never ignored).

#include <string>
#include <string_view>
#include <vector>

namespace moeline {

// The --flags a usage text names ("--max-tokens", ...), each once.
std::vector<std::string> flags_in(std::string_view usage);

// " (did you mean --threads?)" when one of `known` is within a few edits of `flag` (by
// Levenshtein distance, at most a quarter of its length, 1 to 3), else "".
std::string did_you_mean(std::string_view flag, const std::vector<std::string>& known);

// "unknown option '--threds' (did you mean --threads?)": the error for a flag that a command's
// usage text does not name, with the nearest one it does.
std::string unknown_option(std::string_view flag, std::string_view usage);

}  // namespace moeline
