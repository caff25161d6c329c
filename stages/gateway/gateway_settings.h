#pragma once
// The gateway's settings: every key it reads (flags, the config file, MOELINE_<KEY>), with its
// default and help, and the typed settings built from them.

#include <vector>

#include "reuse/policy.h"
#include "stages/runtime/config.h"

namespace moeline::stages {

std::vector<runtime::ConfigKey> gateway_keys();
// The reuse policy's settings: --reuse-levels, --shared-tenants, --approximate-*, --shadow-tokens.
reuse::PolicySettings reuse_settings(const runtime::Config& config);

}  // namespace moeline::stages
