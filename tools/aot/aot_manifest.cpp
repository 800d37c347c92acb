// Kernel fingerprints of the ahead-of-time manifest; see aot_manifest.h.
#include "tools/aot/aot_manifest.h"

#include <cstdio>

namespace kiln::aot {

std::string kernel_fingerprint(const codegen::Kernel& k) {
  const std::string text = k.to_string();
  uint64_t h = 1469598103934665603ull;  // FNV-1a offset basis
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;  // FNV prime
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

}  // namespace kiln::aot
