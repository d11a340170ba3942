// mixprec's boxed autocast kernel: the C++ counterpart of the Python kernels in _dispatch.py.
//
// One boxed function serves every edited overload at AutocastCPU / AutocastCUDA. Python defines
// tables (overload -> cast kind) and sets, per thread and device, the table of the innermost
// mixprec region; an overload the active table does not list runs the kind of PyTorch's own
// table (passed in as table 0 of each device), so outside regions that edit it an overload
// behaves as PyTorch's kernel does. Casts go through at::autocast::cached_cast (PyTorch's own
// eligibility rule and weight-cast cache), and the op runs with every autocast key excluded.
// An overload of kind ROUTE (fp8 layers' linear/addmm) calls the mixprec op Python defined for
// it (define_route) and nothing else: outside the regions that route it, the overload never
// leaves C++ (no Python, no interpreter lock held while PyTorch's cast cache is locked).
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <memory>
#include <optional>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

enum Kind : int64_t { PASSTHROUGH = 0, LOWER = 1, FP32 = 2, PROMOTE = 3, SET_OPT_DTYPE = 4, ROUTE = 5 };

using Table = std::unordered_map<c10::OperatorName, int64_t>;
std::mutex mu;
std::vector<std::shared_ptr<const Table>> tables;  // id -> table; ids 0 and 1: PyTorch's, per device
thread_local int64_t active[2] = {-1, -1};         // per device (0: cpu, 1: cuda), -1: none
std::vector<std::unique_ptr<torch::Library>> libraries;
std::unordered_map<c10::OperatorName, c10::OperatorHandle> routes;  // overload -> the op it calls
// Calls inside kernel() now, in every thread (native threads that Python cannot see included):
// release_kernels() refuses while any is in flight.
std::atomic<int64_t> live{0};
struct Live {
  Live() { live.fetch_add(1, std::memory_order_acq_rel); }
  ~Live() { live.fetch_sub(1, std::memory_order_acq_rel); }
  Live(const Live&) = delete;
  Live& operator=(const Live&) = delete;
};

std::shared_ptr<const Table> table_at(int64_t id) {
  std::lock_guard<std::mutex> guard(mu);
  return id >= 0 && id < static_cast<int64_t>(tables.size()) ? tables[id] : nullptr;
}

int64_t lookup(const std::shared_ptr<const Table>& table, const c10::OperatorName& name) {
  if (!table) return -1;
  auto it = table->find(name);
  return it == table->end() ? -1 : it->second;
}

// The tensors of a Tensor[] argument (empty if it holds anything else, e.g. Tensor?[] Nones).
std::vector<at::Tensor> tensor_list(const c10::IValue& v) {
  std::vector<at::Tensor> out;
  if (!v.isList()) return out;
  for (const auto& e : v.toListRef()) {
    if (!e.isTensor()) return {};
    out.push_back(e.toTensor());
  }
  return out;
}

// "softmax.int" -> aten::softmax, overload "int"; "mm" -> aten::mm, default overload
c10::OperatorName operator_name(const std::string& overload) {
  const auto dot = overload.find('.');
  if (dot == std::string::npos) return c10::OperatorName("aten::" + overload, "");
  return c10::OperatorName("aten::" + overload.substr(0, dot), overload.substr(dot + 1));
}

// While torch.compile traces (fake, functional or proxy tensors: the Python key), call
// mixprec::trace_hook, whose Python kernel makes the compiled code guard on the active policy.
void on_trace(int64_t dev) {
  static const auto hook = c10::Dispatcher::singleton().findOp(c10::OperatorName("mixprec::trace_hook", ""));
  if (hook) hook->typed<void(int64_t)>().call(dev);
}

void kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const Live in_flight;
  const bool cuda = ks.highestPriorityTypeId() == c10::DispatchKey::AutocastCUDA;
  const int dev = cuda ? 1 : 0;
  if (ks.has(c10::DispatchKey::Python) || ks.has(c10::DispatchKey::PythonTLSSnapshot)) on_trace(dev);
  const auto device_type = cuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
  const auto& name = op.operator_name();
  int64_t kind = active[dev] >= 0 ? lookup(table_at(active[dev]), name) : -1;
  if (kind < 0) kind = lookup(table_at(dev), name);
  if (kind < 0) kind = PASSTHROUGH;
  if (kind == ROUTE) {
    std::optional<c10::OperatorHandle> target;
    {
      std::lock_guard<std::mutex> guard(mu);
      auto it = routes.find(name);
      if (it != routes.end()) target = it->second;
    }
    TORCH_CHECK(target.has_value(), "mixprec: no route defined for ", name);
    target->callBoxed(stack);
    return;
  }
  if (kind == PASSTHROUGH) {
    op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::AutocastCPU),
                       stack);
    return;
  }
  const auto& arguments = op.schema().arguments();
  const size_t n = arguments.size();
  auto first = stack->end() - static_cast<std::ptrdiff_t>(n);
  if (kind == SET_OPT_DTYPE) {
    bool eligible = n > 0 && first->isTensor() && at::autocast::is_eligible(first->toTensor(), device_type);
    if (eligible) {
      for (size_t i = 0; i < n; ++i) {
        if (arguments[i].name() == "dtype" && (first + i)->isNone()) {
          *(first + i) = c10::IValue(at::kFloat);
          break;
        }
      }
    }
  } else {
    at::ScalarType to = at::kFloat;
    if (kind == LOWER) {
      to = at::autocast::get_autocast_dtype(device_type);
    } else if (kind == PROMOTE) {
      const auto lower = at::autocast::get_autocast_dtype(device_type);
      to = lower;
      for (size_t i = 0; i < n; ++i) {
        // weighed as PyTorch's promote_type: Tensor and Tensor[] arguments, not an optional
        // Tensor? (bilinear's bias) nor Tensor?[] (index_put's indices), which are cast only
        const auto& type = arguments[i].type();
        const bool weighed = type->kind() == c10::TypeKind::TensorType ||
                             (type->kind() == c10::TypeKind::ListType &&
                              type->containedType(0)->kind() == c10::TypeKind::TensorType);
        if (!weighed) continue;
        const auto& v = *(first + i);
        if (v.isTensor()) {
          to = at::autocast::prioritize(to, v.toTensor(), device_type);
        } else {
          for (const auto& t : tensor_list(v)) to = at::autocast::prioritize(to, t, device_type);
        }
      }
    }
    for (size_t i = 0; i < n; ++i) {
      auto& v = *(first + i);
      if (v.isTensor()) {
        v = c10::IValue(at::autocast::cached_cast(to, v.toTensor(), device_type));
      } else {
        auto tensors = tensor_list(v);
        if (!tensors.empty()) {  // cast one by one (the TensorList overload of cached_cast, inlined
                                 // here, returned its inputs uncast in torch 2.13)
          c10::List<at::Tensor> casted;
          for (const auto& t : tensors) casted.push_back(at::autocast::cached_cast(to, t, device_type));
          v = c10::IValue(std::move(casted));
        }
      }
    }
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  op.callBoxed(stack);
}

void define_table(int64_t id, std::vector<std::string> names, std::vector<int64_t> kinds) {
  TORCH_CHECK(names.size() == kinds.size(), "define_table: names and kinds differ in length");
  auto table = std::make_shared<Table>();
  for (size_t i = 0; i < names.size(); ++i) (*table)[operator_name(names[i])] = kinds[i];
  std::lock_guard<std::mutex> guard(mu);
  if (static_cast<int64_t>(tables.size()) <= id) tables.resize(id + 1);
  tables[id] = table;
}

void set_active(int64_t device, int64_t id) { active[device] = id; }

void define_route(std::string overload, std::string target) {
  auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(target.c_str(), "");
  std::lock_guard<std::mutex> guard(mu);
  routes.insert_or_assign(operator_name(overload), handle);
}

// Overriding PyTorch's kernel is the point: keep the dispatcher's warning about it quiet.
struct Quiet : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

void register_kernel(std::string name, int64_t device) {
  Quiet quiet;
  c10::WarningUtils::WarningHandlerGuard quiet_guard(&quiet);
  const auto key = device == 1 ? c10::DispatchKey::AutocastCUDA : c10::DispatchKey::AutocastCPU;
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", key, __FILE__, __LINE__);
  lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&kernel>());
  std::lock_guard<std::mutex> guard(mu);
  libraries.push_back(std::move(lib));
}

int64_t live_calls() { return live.load(std::memory_order_acquire); }

int64_t release_kernels() {
  std::lock_guard<std::mutex> guard(mu);
  const auto n = static_cast<int64_t>(libraries.size());
  libraries.clear();
  return n;
}

}  // namespace

TORCH_LIBRARY(mixprec_native, m) {
  m.def("define_table(int id, str[] names, int[] kinds) -> ()", &define_table);
  m.def("set_active(int device, int id) -> ()", &set_active);
  m.def("define_route(str overload, str target) -> ()", &define_route);
  m.def("register_kernel(str name, int device) -> ()", &register_kernel);
  m.def("live_calls() -> int", &live_calls);
  m.def("release_kernels() -> int", &release_kernels);
}
