// Model bytes by path: a file on disk, or a model registered in memory under a
// virtual path (the ahead-of-time training binary of `kiln compile` embeds its
// model.onnx and registers it as "embedded:model.onnx"; tools/aot/).
#pragma once
#include <string>
#include <string_view>

#include "ir/status.h"

namespace kiln::frontend {

/// Registers `bytes` (not copied: they must outlive every read) as the content of
/// the virtual path `path`; later reads of `path` return them instead of a file.
void register_model_bytes(const std::string& path, std::string_view bytes);

/// True when `path` was registered with register_model_bytes.
bool is_registered_model(const std::string& path);

/// The whole content of `path` (registered bytes first, else the file).
/// Errors, one line naming the path: not found, a directory, unreadable.
Expected<std::string> read_model_bytes(const std::string& path);

}  // namespace kiln::frontend
