// The Autograd kernel of the differentiable ops. Their gradient formulas are Python (torch_lowbit/_autograd.py),
// but most calls need no gradient -- inference, every decode step -- and a Python autograd kernel makes each of
// them cross into Python and back. This kernel decides in C++: with grad mode off, or no tensor argument that
// requires grad, it runs the op below autograd; otherwise it calls the op's Python function, which records the
// backward.
#pragma once
#include <torch/csrc/utils/pybind.h>

#include <string>

namespace lowbit {

// Route `ns::name`'s Autograd key through the kernel above, `impl(*args)` being what runs when a gradient is
// needed (it gets every argument of the schema, defaults filled in, and returns the op's outputs). Calling it
// again for the same op replaces impl.
void register_autograd(const std::string& ns, const std::string& name, py::object impl);

}  // namespace lowbit
