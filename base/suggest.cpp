#include "base/suggest.h"

#include <algorithm>
#include <cctype>

namespace moeline {
namespace {

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

bool flag_char(char c) {
  return std::islower(static_cast<unsigned char>(c)) ||
         std::isdigit(static_cast<unsigned char>(c)) || c == '-';
}

}  // namespace

std::vector<std::string> flags_in(std::string_view usage) {
  std::vector<std::string> flags;
  for (size_t at = usage.find("--"); at != std::string_view::npos; at = usage.find("--", at + 2)) {
    if (at > 0 && flag_char(usage[at - 1])) continue;  // inside a word ("a--b")
    size_t end = at + 2;
    while (end < usage.size() && flag_char(usage[end])) ++end;
    if (end == at + 2) continue;
    std::string flag(usage.substr(at, end - at));
    if (std::find(flags.begin(), flags.end(), flag) == flags.end()) flags.push_back(flag);
  }
  return flags;
}

std::string did_you_mean(std::string_view flag, const std::vector<std::string>& known) {
  const size_t allowed = std::clamp<size_t>(flag.size() / 4, 1, 3);
  const std::string* best = nullptr;
  size_t best_distance = allowed + 1;
  for (const std::string& candidate : known) {
    const size_t distance = edit_distance(flag, candidate);
    if (distance < best_distance) {
      best_distance = distance;
      best = &candidate;
    }
  }
  return best == nullptr ? "" : " (did you mean " + *best + "?)";
}

std::string unknown_option(std::string_view flag, std::string_view usage) {
  return "unknown option '" + std::string(flag) + "'" + did_you_mean(flag, flags_in(usage));
}

}  // namespace moeline
