// CPU code generation: kernel IR -> LLVM IR (llvm-16) -> O3 -> an ELF object for the host
// (PIC, host CPU and features) -> ORC LLJIT (load_cpu_object) or the system linker (`kiln compile`).
//
// Numerics (must match the eager kernels, runtime/kernels/elementwise.cpp and reduction.cpp):
//  * f32 in float, f64 in double, integers in their own width (u8 unsigned), bool as i1
//    in registers and one byte 0/1 in memory.
//  * bf16/f16 values live in registers as f32 already rounded to the storage precision:
//    loads widen, every op whose dtype is bf16/f16 rounds its f32 result (bf16 by bit ops,
//    RNE with NaN kept quiet exactly as ir::f32_to_bf16; f16 through fptrunc/fpext half),
//    stores narrow.
//  * No fast-math flags on pointwise code (bit-equal to the eager f32 kernels); row sums
//    carry `reassoc` on their accumulating fadd so that they vectorize.
//  * max/min: NaN if either operand is NaN, else std::max/std::min; float->int casts
//    truncate toward zero, saturate, NaN -> 0 (llvm.fpto[su]i.sat = ONNX Cast as eager);
//    integer div truncates, x/0 = 0, x/-1 = -x; integer pow by squaring (kiln_cpu_ipow).
//  * Transcendentals: llvm.log/sin/cos/pow intrinsics (lowered to libm logf, ...) and
//    libm erf/tanh for f64, resolved from the process by the JIT; f32 exp, erf and tanh
//    are inline polynomial code (expf_poly, erff_poly, tanhf_poly: within 1-3 ulp of
//    the correctly rounded value, not bit-equal to libm) so that loops with them
//    vectorize (softmax rows, sigmoid, GELU); so is f64 exp (exp_poly_f64, about 1 ulp).
//  * Float sums of reduction stores accumulate in double in the eager ReduceSum's order
//    (index order, or for sums over leading axes the partitions of
//    ir::column_sum_partitions: split_column), so generated and eager sums are
//    bit-identical; max and integer sums in the register type; starting from 0 (sum) or
//    -inf/lowest (max), stored once. Reduce expressions of row programs accumulate in
//    their dtype's register type (f32 sums in f32 vector lanes, f64 in double): a row
//    rule that wants a double sum of f32 values sums an f64 cast.
//
// Files: this one holds the module level (target machine, O3, object emission, JIT
// link, AOT data objects); cpu_emitter.{h,cpp} the function of one kernel (types,
// memory, expressions, reductions), driving cpu_schedule.{h,cpp} (its loop nest:
// pointwise, row and column reductions, split column reductions), cpu_rows.{h,cpp}
// (row programs: softmax, layer-norm and cross-entropy rows, their scratch plan) and
// cpu_math.{h,cpp} (the polynomial exp, erf and tanh).
#include "codegen/cpu/llvm_cpu.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <map>
#include <mutex>
#include <set>
#include <vector>

#include "codegen/cpu/cpu_emitter.h"
#include "llvm/Analysis/TargetTransformInfo.h"
#include "llvm/AsmParser/Parser.h"
#include "llvm/ExecutionEngine/Orc/ExecutionUtils.h"
#include "llvm/ExecutionEngine/Orc/JITTargetMachineBuilder.h"
#include "llvm/ExecutionEngine/Orc/LLJIT.h"
#include "llvm/ExecutionEngine/Orc/ThreadSafeModule.h"
#include "llvm/IR/DiagnosticHandler.h"
#include "llvm/IR/DiagnosticInfo.h"
#include "llvm/IR/LLVMContext.h"
#include "llvm/IR/LegacyPassManager.h"
#include "llvm/IR/Module.h"
#include "llvm/IR/Verifier.h"
#include "llvm/Passes/PassBuilder.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/SourceMgr.h"
#include "llvm/Support/TargetSelect.h"
#include "llvm/Support/raw_ostream.h"
#include "llvm/Target/TargetMachine.h"
#include "llvm/TargetParser/Host.h"

/// Integer power by squaring with ONNX/numpy negative exponents (as the eager Pow kernel);
/// called by generated code for integer pow (the result is truncated to the dtype's width).
extern "C" int64_t kiln_cpu_ipow(int64_t base, int64_t e) { return kiln::codegen::ipow_wrapping(base, e); }

namespace kiln::codegen {

namespace {

/// Swallows LLVM's remarks, warnings and notes (for example "loop not vectorized" for a
/// loop that carries vectorization hints), which LLVM would print to the user's stderr;
/// errors keep LLVM's default handling.
struct QuietDiagnostics : llvm::DiagnosticHandler {
  bool handleDiagnostics(const llvm::DiagnosticInfo& d) override { return d.getSeverity() != llvm::DS_Error; }
};
void quiet_diagnostics(llvm::LLVMContext& ctx) { ctx.setDiagnosticHandler(std::make_unique<QuietDiagnostics>()); }

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string llvm_error(llvm::Error e) { return llvm::toString(std::move(e)); }

void init_native_target() {
  static std::once_flag once;
  std::call_once(once, [] {
    llvm::InitializeNativeTarget();
    llvm::InitializeNativeTargetAsmPrinter();
  });
}

std::string host_features_string() {
  llvm::StringMap<bool> feats;
  std::set<std::string> sorted;
  if (llvm::sys::getHostCPUFeatures(feats))
    for (const auto& f : feats) sorted.insert((f.second ? "+" : "-") + f.first().str());
  std::string s;
  for (const auto& f : sorted) s += (s.empty() ? "" : ",") + f;
  return s;
}

/// Host target machine (cpu, features, O3 codegen).
Expected<std::unique_ptr<llvm::TargetMachine>> host_target_machine(llvm::orc::JITTargetMachineBuilder& jtmb) {
  auto tm = jtmb.createTargetMachine();
  if (!tm) return Status::error("LLVM: cannot create the host target machine: " + llvm_error(tm.takeError()));
  return std::move(*tm);
}

Expected<llvm::orc::JITTargetMachineBuilder> host_jtmb() {
  init_native_target();
  auto jtmb = llvm::orc::JITTargetMachineBuilder::detectHost();
  if (!jtmb) return Status::error("LLVM: cannot detect the host target: " + llvm_error(jtmb.takeError()));
  jtmb->setCPU(llvm::sys::getHostCPUName().str());
  jtmb->setCodeGenOptLevel(llvm::CodeGenOpt::Aggressive);
  return std::move(*jtmb);
}

/// Verifies, collapses and emits `kernels` into `m`; returns their schedules.
Expected<std::vector<CpuKernel>> emit_module(const std::vector<Kernel>& kernels, llvm::Module& m,
                                             const std::string& cpu, const std::string& feats,
                                             std::vector<int>* alias_of = nullptr,
                                             const std::vector<std::string>* fn_names = nullptr) {
  std::set<std::string> names;
  std::map<std::string, int> by_key;  // structure_key -> first kernel with it
  std::vector<CpuKernel> out;
  for (size_t i = 0; i < kernels.size(); ++i) {
    const Kernel& k = kernels[i];
    KILN_RETURN_IF_ERROR(k.verify());
    if (!names.insert(k.name).second) return Status::error("kernel '" + k.name + "': duplicate kernel name");
    Kernel c = collapse_dims(k);
    if (alias_of) {
      // Structurally equal kernels (the AdamW update of same-shaped parameters, ...)
      // share one generated function.
      auto [it, fresh] = by_key.emplace(structure_key(c), static_cast<int>(i));
      alias_of->push_back(fresh ? -1 : it->second);
      if (!fresh) {
        CpuKernel ck = out[it->second];
        ck.name = k.name;
        out.push_back(ck);
        continue;
      }
    }
    cpu::KernelEmitter em(m, c, cpu, feats, fn_names ? (*fn_names)[i] : std::string());
    out.push_back(em.emit());
  }
  std::string err;
  llvm::raw_string_ostream os(err);
  if (llvm::verifyModule(m, &os))
    return Status::error("kernel module (first kernel '" + (kernels.empty() ? std::string() : kernels[0].name) +
                         "'): LLVM verifier: " + os.str());
  return out;
}

std::string print_module(const llvm::Module& m) {
  std::string s;
  llvm::raw_string_ostream os(s);
  m.print(os, nullptr);
  return os.str();
}

class CpuModuleImpl : public CpuModule {
 public:
  const std::vector<CpuKernel>& kernels() const override { return kernels_; }
  const std::string& llvm_ir() const override { return ir_; }
  const CpuCompileStats& stats() const override { return stats_; }

  std::unique_ptr<llvm::orc::LLJIT> jit;
  std::vector<CpuKernel> kernels_;
  std::string ir_;
  CpuCompileStats stats_;
};

}  // namespace

namespace {

/// Host target machine for object emission: PIC relocations (links into PIE executables),
/// small code model, O3 code generation.
Expected<std::unique_ptr<llvm::TargetMachine>> object_target_machine() {
  KILN_ASSIGN_OR_RETURN(auto jtmb, host_jtmb());
  jtmb.setRelocationModel(llvm::Reloc::PIC_);
  jtmb.setCodeModel(llvm::CodeModel::Small);
  return host_target_machine(jtmb);
}

/// Runs LLVM's O3 module pipeline (no unrolling, loop and SLP vectorizers on).
void optimize_o3(llvm::Module& m, llvm::TargetMachine& tm) {
  llvm::LoopAnalysisManager lam;
  llvm::FunctionAnalysisManager fam;
  llvm::CGSCCAnalysisManager cgam;
  llvm::ModuleAnalysisManager mam;
  llvm::PipelineTuningOptions pto;
  pto.LoopVectorization = true;
  pto.SLPVectorization = true;
  pto.LoopUnrolling = false;  // vector loops stay compact: most of the compile time was unrolled code
  llvm::PassBuilder pb(&tm, pto);
  fam.registerPass([&] { return tm.getTargetIRAnalysis(); });
  pb.registerModuleAnalyses(mam);
  pb.registerCGSCCAnalyses(cgam);
  pb.registerFunctionAnalyses(fam);
  pb.registerLoopAnalyses(lam);
  pb.crossRegisterProxies(lam, fam, cgam, mam);
  llvm::ModulePassManager mpm = pb.buildPerModuleDefaultPipeline(llvm::OptimizationLevel::O3);
  mpm.run(m, mam);
}

/// Machine code of `m` as an ELF relocatable object.
Expected<std::string> emit_object(llvm::Module& m, llvm::TargetMachine& tm, const std::string& what) {
  llvm::SmallVector<char, 0> buf;
  llvm::raw_svector_ostream os(buf);
  llvm::legacy::PassManager pm;
  if (tm.addPassesToEmitFile(pm, os, nullptr, llvm::CGFT_ObjectFile))
    return Status::error("LLVM: the host target cannot emit object files (" + what + ")");
  pm.run(m);
  return std::string(buf.data(), buf.size());
}

bool is_c_identifier(const std::string& s) {
  if (s.empty() || std::isdigit(static_cast<unsigned char>(s[0]))) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_')) return false;
  return true;
}

/// compile_cpu_object with a naming rule: symbol of kernel i (raw = the kernel's own name).
Expected<CpuObject> compile_object(const std::vector<Kernel>& kernels, const std::string* prefix) {
  using clock = std::chrono::steady_clock;
  CpuObject obj;
  obj.stats.num_kernels = static_cast<int>(kernels.size());
  KILN_ASSIGN_OR_RETURN(auto tm, object_target_machine());
  const std::string cpu = tm->getTargetCPU().str(), feats = tm->getTargetFeatureString().str();

  std::vector<std::string> names;
  for (size_t i = 0; i < kernels.size(); ++i) {
    if (!prefix) {
      names.push_back(kernels[i].name);
      continue;
    }
    std::string n = *prefix + std::to_string(i) + "_" + kernels[i].name;
    for (size_t c = prefix->size(); c < n.size(); ++c)
      if (!(std::isalnum(static_cast<unsigned char>(n[c])) || n[c] == '_')) n[c] = '_';
    names.push_back(std::move(n));
  }

  auto t0 = clock::now();
  llvm::LLVMContext ctx;
  quiet_diagnostics(ctx);
  llvm::Module m("kiln_cpu", ctx);
  m.setTargetTriple(tm->getTargetTriple().str());
  m.setDataLayout(tm->createDataLayout());
  std::vector<int> alias_of;
  KILN_ASSIGN_OR_RETURN(obj.kernels, emit_module(kernels, m, cpu, feats, &alias_of, &names));
  obj.stats.emit_s = seconds_since(t0);
  int unique = 0;
  for (size_t i = 0; i < kernels.size(); ++i) {
    obj.symbols.push_back(alias_of[i] >= 0 ? obj.symbols[alias_of[i]] : names[i]);
    unique += alias_of[i] < 0;
  }
  obj.stats.num_unique = unique;

  t0 = clock::now();
  optimize_o3(m, *tm);
  obj.llvm_ir = print_module(m);
  obj.stats.optimize_s = seconds_since(t0);

  t0 = clock::now();
  KILN_ASSIGN_OR_RETURN(
      obj.object, emit_object(m, *tm, kernels.empty() ? "empty module" : "first kernel '" + kernels[0].name + "'"));
  obj.stats.codegen_s = seconds_since(t0);
  return obj;
}

}  // namespace

Expected<CpuObject> compile_cpu_object(const std::vector<Kernel>& kernels, const CpuObjectOptions& opts) {
  return compile_object(kernels, &opts.symbol_prefix);
}

Expected<std::unique_ptr<CpuModule>> load_cpu_object(const CpuObject& obj) {
  const auto t0 = std::chrono::steady_clock::now();
  if (obj.symbols.size() != obj.kernels.size())
    return Status::error("kernel object: " + std::to_string(obj.symbols.size()) + " symbols for " +
                         std::to_string(obj.kernels.size()) + " kernels");
  auto mod = std::make_unique<CpuModuleImpl>();
  mod->kernels_ = obj.kernels;
  mod->ir_ = obj.llvm_ir;
  mod->stats_ = obj.stats;
  if (obj.kernels.empty()) return std::unique_ptr<CpuModule>(std::move(mod));
  KILN_ASSIGN_OR_RETURN(auto jtmb, host_jtmb());
  auto jit = llvm::orc::LLJITBuilder().setJITTargetMachineBuilder(std::move(jtmb)).create();
  if (!jit) return Status::error("LLVM: cannot create LLJIT: " + llvm_error(jit.takeError()));
  llvm::orc::JITDylib& jd = (*jit)->getMainJITDylib();
  auto gen = llvm::orc::DynamicLibrarySearchGenerator::GetForCurrentProcess((*jit)->getDataLayout().getGlobalPrefix());
  if (!gen) return Status::error("LLVM: process symbol search: " + llvm_error(gen.takeError()));
  jd.addGenerator(std::move(*gen));
  llvm::orc::SymbolMap syms;
  syms[(*jit)->mangleAndIntern("kiln_cpu_ipow")] = llvm::JITEvaluatedSymbol(
      llvm::pointerToJITTargetAddress(&kiln_cpu_ipow), llvm::JITSymbolFlags::Exported | llvm::JITSymbolFlags::Callable);
  if (auto err = jd.define(llvm::orc::absoluteSymbols(std::move(syms))))
    return Status::error("LLVM: cannot define runtime symbols: " + llvm_error(std::move(err)));
  if (auto err = (*jit)->addObjectFile(llvm::MemoryBuffer::getMemBufferCopy(obj.object, "kiln_cpu.o")))
    return Status::error("LLVM: cannot add the kernel object: " + llvm_error(std::move(err)));
  std::map<std::string, CpuKernelFn> by_symbol;
  for (size_t i = 0; i < mod->kernels_.size(); ++i) {
    CpuKernel& ck = mod->kernels_[i];
    auto it = by_symbol.find(obj.symbols[i]);
    if (it == by_symbol.end()) {
      auto addr = (*jit)->lookup(obj.symbols[i]);
      if (!addr)
        return Status::error("kernel '" + ck.name + "': JIT link of symbol '" + obj.symbols[i] +
                             "' failed: " + llvm_error(addr.takeError()));
      it = by_symbol.emplace(obj.symbols[i], addr->toPtr<CpuKernelFn>()).first;
    }
    ck.fn = it->second;
  }
  mod->stats_.num_unique = static_cast<int>(by_symbol.size());
  mod->jit = std::move(*jit);
  mod->stats_.codegen_s += seconds_since(t0);
  return std::unique_ptr<CpuModule>(std::move(mod));
}

Expected<std::unique_ptr<CpuModule>> compile_cpu(const std::vector<Kernel>& kernels) {
  KILN_ASSIGN_OR_RETURN(CpuObject obj, compile_object(kernels, nullptr));
  return load_cpu_object(obj);
}

Expected<std::string> emit_aot_data_object(const std::vector<std::pair<std::string, std::string>>& blobs,
                                           const std::string& table_symbol,
                                           const std::vector<std::string>& fn_symbols) {
  std::set<std::string> defined;
  auto define = [&](const std::string& s) -> Status {
    if (!is_c_identifier(s)) return Status::error("AOT data object: symbol '" + s + "' is not a C identifier");
    if (!defined.insert(s).second) return Status::error("AOT data object: symbol '" + s + "' defined twice");
    return Status::ok();
  };
  for (const auto& [name, bytes] : blobs) {
    KILN_RETURN_IF_ERROR(define(name));
    KILN_RETURN_IF_ERROR(define(name + "_size"));
  }
  KILN_RETURN_IF_ERROR(define(table_symbol));
  KILN_RETURN_IF_ERROR(define(table_symbol + "_count"));
  for (const std::string& f : fn_symbols) {
    if (!is_c_identifier(f)) return Status::error("AOT data object: function symbol '" + f + "' is not a C identifier");
    if (defined.count(f))
      return Status::error("AOT data object: function symbol '" + f + "' clashes with a data symbol");
  }
  KILN_ASSIGN_OR_RETURN(auto tm, object_target_machine());
  llvm::LLVMContext ctx;
  llvm::Module m("kiln_aot_data", ctx);
  m.setTargetTriple(tm->getTargetTriple().str());
  m.setDataLayout(tm->createDataLayout());
  auto* i64 = llvm::Type::getInt64Ty(ctx);
  auto* ptr = llvm::PointerType::getUnqual(ctx);
  auto add_global = [&](const std::string& name, llvm::Constant* init, unsigned align) {
    auto* g = new llvm::GlobalVariable(m, init->getType(), /*isConstant=*/true, llvm::GlobalValue::ExternalLinkage,
                                       init, name);
    g->setAlignment(llvm::Align(align));
  };
  for (const auto& [name, bytes] : blobs) {
    add_global(name, llvm::ConstantDataArray::getString(ctx, bytes, /*AddNull=*/true), 64);
    add_global(name + "_size", llvm::ConstantInt::get(i64, bytes.size()), 8);
  }
  std::vector<llvm::Constant*> fns;
  auto* fty = llvm::FunctionType::get(llvm::Type::getVoidTy(ctx), false);
  for (const std::string& f : fn_symbols) {
    llvm::Function* fn = m.getFunction(f);
    if (!fn) fn = llvm::Function::Create(fty, llvm::Function::ExternalLinkage, f, m);
    fns.push_back(fn);
  }
  add_global(table_symbol, llvm::ConstantArray::get(llvm::ArrayType::get(ptr, fns.size()), fns), 8);
  add_global(table_symbol + "_count", llvm::ConstantInt::get(i64, fns.size()), 8);
  std::string err;
  llvm::raw_string_ostream os(err);
  if (llvm::verifyModule(m, &os)) return Status::error("AOT data object: LLVM verifier: " + os.str());
  return emit_object(m, *tm, "AOT data object");
}

Status verify_llvm_ir_text(const std::string& text) {
  llvm::LLVMContext ctx;
  llvm::SMDiagnostic diag;
  std::unique_ptr<llvm::Module> m = llvm::parseAssemblyString(text, diag, ctx);
  if (!m) {
    std::string msg;
    llvm::raw_string_ostream os(msg);
    diag.print("llvm_ir", os, /*ShowColors=*/false);
    os.flush();
    while (!msg.empty() && msg.back() == '\n') msg.pop_back();
    return Status::error("LLVM IR parse error: " + msg);
  }
  std::string err;
  llvm::raw_string_ostream os(err);
  if (llvm::verifyModule(*m, &os)) {
    os.flush();
    while (!err.empty() && err.back() == '\n') err.pop_back();
    return Status::error("LLVM verifier: " + err);
  }
  return Status::ok();
}

/// LLVM IR of `kernels` before optimization, for `cpu` and `feats` (the host's when null).
static Expected<std::string> emit_llvm_ir_for(const std::vector<Kernel>& kernels, const std::string* cpu,
                                              const std::string* feats) {
  KILN_ASSIGN_OR_RETURN(auto jtmb, host_jtmb());
  KILN_ASSIGN_OR_RETURN(auto tm, host_target_machine(jtmb));
  llvm::LLVMContext ctx;
  quiet_diagnostics(ctx);
  llvm::Module m("kiln_cpu", ctx);
  m.setTargetTriple(tm->getTargetTriple().str());
  m.setDataLayout(tm->createDataLayout());
  KILN_ASSIGN_OR_RETURN(auto ks, emit_module(kernels, m, cpu ? *cpu : tm->getTargetCPU().str(),
                                             feats ? *feats : tm->getTargetFeatureString().str()));
  (void)ks;
  return print_module(m);
}

Expected<std::string> emit_llvm_ir(const std::vector<Kernel>& kernels) {
  return emit_llvm_ir_for(kernels, nullptr, nullptr);
}

Expected<std::string> emit_llvm_ir(const std::vector<Kernel>& kernels, const std::string& cpu,
                                   const std::string& features) {
  return emit_llvm_ir_for(kernels, &cpu, &features);
}

std::string host_cpu_description() { return llvm::sys::getHostCPUName().str() + " " + host_features_string(); }

}  // namespace kiln::codegen
