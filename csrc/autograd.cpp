#include "autograd.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/library.h>

#include <memory>
#include <unordered_map>

namespace lowbit {
namespace {

// "ns::name" -> the Python function run when a gradient is needed. Leaked on purpose: Python objects must not be
// destroyed after the interpreter has finalized. Read and written with the GIL held.
std::unordered_map<std::string, py::object>& grad_impls() {
  static auto* m = new std::unordered_map<std::string, py::object>();
  return *m;
}

bool requires_grad(const c10::IValue& v) {
  if (v.isTensor()) return v.toTensor().requires_grad();
  if (v.isTensorList())
    for (const at::Tensor& t : v.toTensorVector())
      if (t.requires_grad()) return true;
  return false;
}

// The argument as Python's op call takes it (what the schemas of these ops hold: tensors, optional tensors,
// int lists, dtypes). Converted here rather than through torch's generic IValue conversion, whose header costs
// this file most of its build time.
py::object to_python(const c10::Argument& a, const c10::IValue& v) {
  if (v.isNone()) return py::none();
  if (v.isTensor()) return py::cast(v.toTensor());
  if (v.isInt()) {
    c10::TypePtr t = a.real_type();
    if (const auto* opt = t->castRaw<c10::OptionalType>()) t = opt->getElementType();
    if (t->kind() == c10::TypeKind::ScalarTypeType)  // a boxed ScalarType is an int; Python wants a torch.dtype
      return py::reinterpret_borrow<py::object>(
          reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<c10::ScalarType>(v.toInt()))));
    return py::int_(v.toInt());
  }
  if (v.isList()) {
    py::list out;
    for (const c10::IValue& e : v.toListRef()) {
      if (e.isInt()) out.append(py::int_(e.toInt()));
      else if (e.isSymInt()) out.append(py::cast(e.toSymInt()));
      else if (e.isTensor()) out.append(py::cast(e.toTensor()));
      else TORCH_CHECK(false, "autograd kernel: argument ", a.name(), " holds a list element it cannot convert");
    }
    return out;
  }
  if (v.isSymInt()) return py::cast(v.toSymInt());
  if (v.isDouble()) return py::float_(v.toDouble());
  if (v.isBool()) return py::bool_(v.toBool());
  if (v.isString()) return py::str(v.toStringRef());
  TORCH_CHECK(false, "autograd kernel: argument ", a.name(), " has a kind it cannot convert (", v.tagKind(), ")");
}

void autograd_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t n = schema.arguments().size();
  bool grad = false;
  if (at::GradMode::is_enabled())
    for (const c10::IValue& v : torch::jit::last(*stack, n)) grad = grad || requires_grad(v);
  if (!grad) {
    at::AutoDispatchBelowAutograd below;
    op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
    return;
  }
  py::gil_scoped_acquire gil;
  const auto it = grad_impls().find(schema.name());
  TORCH_CHECK(it != grad_impls().end(), schema.name(), ": no gradient formula is registered");
  py::tuple args(n);
  const auto in = torch::jit::last(*stack, n);
  for (size_t i = 0; i < n; i++) args[i] = to_python(schema.arguments()[i], in[i]);
  const py::object out = it->second(*args);
  torch::jit::drop(*stack, n);
  const size_t r = schema.returns().size();
  if (r == 1) {
    torch::jit::push(*stack, py::cast<at::Tensor>(out));
    return;
  }
  const auto outs = py::cast<py::tuple>(out);
  TORCH_CHECK(outs.size() == r, schema.name(), ": the gradient function returned ", outs.size(), " outputs, expected ",
              r);
  for (size_t i = 0; i < r; i++) torch::jit::push(*stack, py::cast<at::Tensor>(outs[i]));
}

}  // namespace

void register_autograd(const std::string& ns, const std::string& name, py::object impl) {
  const std::string qualified = ns + "::" + name;
  const auto op = c10::Dispatcher::singleton().findSchema({qualified, ""});
  TORCH_CHECK(op.has_value(), "register_autograd: no op ", qualified);
  for (const c10::Argument& r : op->schema().returns())
    TORCH_CHECK(r.type()->kind() == c10::TypeKind::TensorType, "register_autograd: ", qualified,
                " returns a non-tensor, which the Autograd kernel does not convert");
  auto& impls = grad_impls();
  const bool registered = impls.count(qualified) > 0;
  impls[qualified] = std::move(impl);
  if (registered) return;
  static auto* libraries = new std::unordered_map<std::string, std::unique_ptr<torch::Library>>();
  auto& lib = (*libraries)[ns];
  if (!lib) lib = std::make_unique<torch::Library>(torch::Library::IMPL, ns, c10::DispatchKey::Autograd, __FILE__, __LINE__);
  lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&autograd_kernel>());
}

}  // namespace lowbit
