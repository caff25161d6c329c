#pragma once
// `moeline offload`: owns expert residency on a node. Compute processes ask it where the experts
// are (ExpertPlan) before they take work, and report how often each expert is used. Until tiering
// lands every expert is resident in each compute process's mapping of the checkpoint; the plan,
// the usage statistics and the router-health metrics (per-expert token counts, load imbalance)
// are already real.
namespace moeline::stages {
int offload_main(int argc, char** argv);
}
