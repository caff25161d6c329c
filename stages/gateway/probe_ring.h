#pragma once
// Which probe replica owns a namespace. Namespaces are spread over the live probes by consistent
// hashing of the replicas' names (kPoints points each on a 64-bit ring), so that a replica that
// joins or leaves moves only its own share: what it held is then lost as cache, never served
// wrong (entries are keyed by what they were computed from). Replica names must be stable across
// restarts (the stack's probe-0, probe-1; a StatefulSet's pod names) for a restarted probe to get
// its share, and its store, back.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace moeline::stages {

class ProbeRing {
 public:
  static constexpr int kPoints = 64;

  // Rebuilds the ring when the set of replicas changed (cheap when it did not).
  void update(std::vector<std::string> replicas);
  // The owner of a namespace; empty when there is no replica.
  const std::string& owner(const std::string& cache_namespace) const;
  size_t size() const { return replicas_.size(); }

 private:
  std::vector<std::string> replicas_;                  // sorted
  std::vector<std::pair<uint64_t, uint32_t>> points_;  // (hash, replica index), sorted
};

}  // namespace moeline::stages
