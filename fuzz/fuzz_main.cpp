// One libFuzzer target per reader: built once per target name with -DKILN_FUZZ_TARGET=...
// (fuzz/CMakeLists.txt); each input goes through fuzz::run_target (harness.h).
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/harness.h"

#ifndef KILN_FUZZ_TARGET
#error "build with -DKILN_FUZZ_TARGET=\"name\""
#endif

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kiln::fuzz::run_target(KILN_FUZZ_TARGET, std::string(reinterpret_cast<const char*>(data), size));
  return 0;
}
