#include "runtime/cuda/cuda_backend.h"

#include <unordered_map>

#include "codegen/cuda/cuda_emitter.h"
#include "codegen/cuda/nvrtc.h"
#include "codegen/lower.h"
#include "ir/op_table.h"

namespace kiln::runtime {

namespace {

using ir::Tensor;

/// A graph loaded on the device: its module, per node the kernel's launch info (null for
/// a view), and its initializers and input defaults already on the device.
struct CudaExecutable : Executable {
  const ir::Graph* g = nullptr;
  CudaModule* module = nullptr;
  std::vector<const codegen::CudaKernelInfo*> launches;  ///< per node; null: a view
  std::vector<codegen::Kernel> kernels;                  ///< per fused node, in node order
  codegen::CudaModuleSource source;
  std::unordered_map<const ir::Value*, Tensor> resident;  ///< initializers and input defaults
  const ir::Graph& graph() const override { return *g; }
};

class CudaBackend : public Backend {
 public:
  CudaBackend(std::shared_ptr<CudaDevice> dev, int ordinal) : dev_(std::move(dev)), ordinal_(ordinal) {}
  std::string name() const override { return "cuda"; }
  ir::Device device() const override { return ir::Device::cuda(ordinal_); }

  Expected<Tensor> zeros(ir::DType dtype, const std::vector<int64_t>& dims) override {
    KILN_ASSIGN_OR_RETURN(Tensor t, empty(dtype, dims));
    KILN_RETURN_IF_ERROR(dev_->memset8(address(t), 0, t.nbytes()));
    return t;
  }

  Expected<Tensor> to_device(const Tensor& host) override {
    if (host.device() == device()) return host;
    if (!host.device().is_cpu()) return Status::error("cuda backend: to_device of a tensor on " + host.device().str());
    KILN_ASSIGN_OR_RETURN(Tensor t, empty(host.dtype(), host.dims()));
    KILN_RETURN_IF_ERROR(dev_->copy_to_device(address(t), host.raw(), host.nbytes()));
    return t;
  }

  Expected<Tensor> to_host(const Tensor& t) override {
    if (t.device().is_cpu()) return t;
    if (t.device() != device()) return Status::error("cuda backend: to_host of a tensor on " + t.device().str());
    Tensor h = Tensor::uninitialized(t.dtype(), t.dims());
    KILN_RETURN_IF_ERROR(dev_->copy_to_host(h.raw(), address(t), t.nbytes()));
    return h;
  }

  Expected<std::unique_ptr<Executable>> load(const ir::Graph& g, const ProgramParts&) override {
    auto ex = std::make_unique<CudaExecutable>();
    ex->g = &g;
    std::vector<int> kernel_of(g.nodes().size(), -1);
    for (size_t i = 0; i < g.nodes().size(); ++i) {
      const ir::Node& n = *g.nodes()[i];
      const std::string where = "cuda backend: node '" + n.name + "' (" + n.op + ")";
      if (ir::has_trait(n, ir::OpTrait::fused_kernel)) {
        auto k = codegen::lower_fused(n);
        if (!k) return Status::error(where + ": " + k.message());
        kernel_of[i] = static_cast<int>(ex->kernels.size());
        ex->kernels.push_back(std::move(*k));
      } else if (!(ir::is_view_op(n.op) && n.num_outputs() == 1 && n.outputs[0]->shape.is_static())) {
        return Status::error(where + " has no CUDA lowering yet (this backend runs fused kernels and views)");
      }
    }
    if (!ex->kernels.empty()) {
      KILN_ASSIGN_OR_RETURN(ex->source, codegen::emit_cuda(ex->kernels));
      codegen::NvrtcOptions o;
      o.arch = dev_->arch();
      KILN_ASSIGN_OR_RETURN(codegen::NvrtcOutput img, codegen::nvrtc_compile(ex->source.source, "kiln_graph", o));
      KILN_ASSIGN_OR_RETURN(ex->module, dev_->load_module(img.image));
    }
    ex->launches.assign(g.nodes().size(), nullptr);
    for (size_t i = 0; i < kernel_of.size(); ++i)
      if (kernel_of[i] >= 0) ex->launches[i] = &ex->source.kernels[kernel_of[i]];
    for (ir::Value* v : g.initializers) {
      KILN_ASSIGN_OR_RETURN(Tensor t, to_device(*v->data));
      ex->resident[v] = std::move(t);
    }
    for (ir::Value* in : g.inputs)
      if (auto d = g.input_defaults.find(in->name); d != g.input_defaults.end() && d->second) {
        KILN_ASSIGN_OR_RETURN(Tensor t, to_device(*d->second));
        ex->resident[in] = std::move(t);
      }
    return std::unique_ptr<Executable>(std::move(ex));
  }

  Expected<std::map<std::string, Tensor>> run(Executable& e, const std::map<std::string, Tensor>& feeds,
                                              const RunOptions&) override {
    auto* ex = dynamic_cast<CudaExecutable*>(&e);
    if (!ex) return Status::error("cuda backend: the executable was loaded by another backend");
    const ir::Graph& g = *ex->g;
    std::unordered_map<const ir::Value*, Tensor> env(ex->resident.begin(), ex->resident.end());
    for (ir::Value* in : g.inputs) {
      auto it = feeds.find(in->name);
      if (it == feeds.end()) {
        if (env.count(in)) continue;  // its default
        return Status::error("missing input '" + in->name + "'");
      }
      const Tensor& t = it->second;
      if (!t.device().is_cpu() && t.device() != device())
        return Status::error("input '" + in->name + "': the tensor is on " + t.device().str() +
                             ", this backend runs on " + device().str());
      KILN_ASSIGN_OR_RETURN(Tensor d, to_device(t));
      if (d.dtype() != in->dtype || (in->shape.is_static() && d.dims() != in->shape.to_vector()))
        return Status::error("input '" + in->name + "': expected " + std::string(ir::dtype_name(in->dtype)) + " " +
                             in->shape.to_string() + ", got " + ir::dtype_name(d.dtype()) + " " +
                             ir::dims_to_string(d.dims()));
      env[in] = std::move(d);
    }
    for (size_t i = 0; i < g.nodes().size(); ++i) {
      const ir::Node& n = *g.nodes()[i];
      const codegen::CudaKernelInfo* info = ex->launches[i];
      auto input = [&](int k) -> Expected<Tensor> {
        auto it = n.inputs[k] ? env.find(n.inputs[k]) : env.end();
        if (it == env.end())
          return Status::error("node '" + n.name + "': input " + std::to_string(k) + " was not computed");
        return it->second;
      };
      if (!info) {  // a view: the input's buffer with the output's dims
        KILN_ASSIGN_OR_RETURN(Tensor in, input(0));
        env[n.outputs[0]] = in.reshaped(n.outputs[0]->shape.to_vector());
        continue;
      }
      const codegen::Kernel& k = ex->kernels[kernel_index(*ex, info)];
      std::vector<CudaDevicePtr> bufs(k.params.size());
      std::vector<Tensor> outs(n.outputs.size());
      for (int p = 0; p < n.num_inputs(); ++p) {
        KILN_ASSIGN_OR_RETURN(Tensor t, input(p));
        bufs[p] = address(t);
      }
      for (size_t o = 0; o < n.outputs.size(); ++o) {
        const ir::Value* v = n.outputs[o];
        const codegen::KernelParam& kp = k.params[n.num_inputs() + o];
        if (kp.in_place_of >= 0) {
          // Written through the input's pointer: give it a copy, so the input stays intact.
          KILN_ASSIGN_OR_RETURN(Tensor src, input(kp.in_place_of));
          KILN_ASSIGN_OR_RETURN(outs[o], empty(v->dtype, v->shape.to_vector()));
          KILN_RETURN_IF_ERROR(dev_->copy_on_device(address(outs[o]), address(src), src.nbytes()));
          bufs[kp.in_place_of] = address(outs[o]);
        } else {
          KILN_ASSIGN_OR_RETURN(outs[o], empty(v->dtype, v->shape.to_vector()));
        }
        bufs[n.num_inputs() + o] = address(outs[o]);
      }
      KILN_RETURN_IF_ERROR(dev_->launch(ex->module, *info, bufs).with_context("node '" + n.name + "'"));
      for (size_t o = 0; o < n.outputs.size(); ++o) env[n.outputs[o]] = std::move(outs[o]);
    }
    KILN_RETURN_IF_ERROR(dev_->synchronize());
    std::map<std::string, Tensor> result;
    for (ir::Value* o : g.outputs) {
      auto it = env.find(o);
      if (it == env.end()) return Status::error("graph output '" + o->name + "' was not computed");
      result[o->name] = it->second;
    }
    return result;
  }

 private:
  static size_t kernel_index(const CudaExecutable& ex, const codegen::CudaKernelInfo* info) {
    return static_cast<size_t>(info - ex.source.kernels.data());
  }
  static CudaDevicePtr address(const Tensor& t) {
    return static_cast<CudaDevicePtr>(reinterpret_cast<uintptr_t>(t.raw()));
  }
  /// An uninitialised device buffer for `dims`, freed by its storage.
  Expected<Tensor> empty(ir::DType dtype, const std::vector<int64_t>& dims) {
    const size_t bytes = static_cast<size_t>(ir::numel_of(dims)) * ir::dtype_size(dtype);
    KILN_ASSIGN_OR_RETURN(CudaDevicePtr p, dev_->alloc(bytes));
    std::shared_ptr<CudaDevice> dev = dev_;
    auto storage = std::make_shared<ir::Storage>(
        device(), reinterpret_cast<void*>(static_cast<uintptr_t>(p)), bytes,
        [dev](void* a) { (void)dev->free(static_cast<CudaDevicePtr>(reinterpret_cast<uintptr_t>(a))); });
    return Tensor::over(std::move(storage), dtype, dims);
  }

  std::shared_ptr<CudaDevice> dev_;
  int ordinal_;
};

}  // namespace

Expected<std::unique_ptr<Backend>> open_cuda_backend(int ordinal) {
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<CudaDevice> dev, CudaDevice::open(ordinal));
  return std::unique_ptr<Backend>(std::make_unique<CudaBackend>(std::shared_ptr<CudaDevice>(std::move(dev)), ordinal));
}

}  // namespace kiln::runtime
