#pragma once
// `moeline probe`: looks up every job before prefill and answers its reuse plan. Reuse lands with
// the next issues; until then every plan is "none", but every job goes through this process, so
// the data path, the credits and the failure handling are the real ones.
namespace moeline::stages {
int probe_main(int argc, char** argv);
}
