// llama.cpp's own quantizer (llama_model_quantize, what its llama-quantize tool calls), loaded
// from the prebuilt library node-llama-cpp ships (scripts/bench installs it), so a GGUF written
// by llama.cpp can be compared with one written by `moeline quantize` (bench/quant_compare.py).
//
//   llama_quantize LIBLLAMA.so IN.gguf OUT.gguf FTYPE THREADS
//
// FTYPE is llama.cpp's llama_ftype number (7 Q8_0, 15 Q4_K_M, 17 Q5_K_M). Built by the script
// with `cc -O2 llama_quantize.c -ldl`; nothing of llama.cpp is compiled into the repository.
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

// llama_model_quantize_params as llama.h declares it begins with `int32_t nthread; int32_t
// ftype;` in every release; the rest is left as llama_model_quantize_default_params() fills it.
// A buffer larger than any release's struct receives it: both return it through a hidden pointer.
typedef struct {
  int32_t nthread;
  int32_t ftype;
  unsigned char rest[4096];
} quantize_params;

typedef quantize_params (*default_params_fn)(void);
typedef uint32_t (*quantize_fn)(const char*, const char*, const quantize_params*);
typedef void (*backend_init_fn)(void);

static void* symbol(void* library, const char* name) {
  void* found = dlsym(library, name);
  if (!found) {
    fprintf(stderr, "llama_quantize: %s not found: %s\n", name, dlerror());
    exit(2);
  }
  return found;
}

int main(int argc, char** argv) {
  if (argc != 6) {
    fprintf(stderr, "usage: llama_quantize LIBLLAMA.so IN.gguf OUT.gguf FTYPE THREADS\n");
    return 2;
  }
  void* library = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
  if (!library) {
    fprintf(stderr, "llama_quantize: cannot load %s: %s\n", argv[1], dlerror());
    return 2;
  }
  ((backend_init_fn)symbol(library, "llama_backend_init"))();
  quantize_params params =
      ((default_params_fn)symbol(library, "llama_model_quantize_default_params"))();
  params.nthread = atoi(argv[5]);
  params.ftype = atoi(argv[4]);
  const uint32_t failed =
      ((quantize_fn)symbol(library, "llama_model_quantize"))(argv[2], argv[3], &params);
  if (failed) {
    fprintf(stderr, "llama_quantize: llama_model_quantize failed (%u)\n", failed);
    return 1;
  }
  return 0;
}
