// The one Python module of the MindSpore extension; see module.h.
#include "ms_module/module.h"

#include <utility>

#include "ms_extension/api.h"

namespace opmux {

ModuleRegistry &ModuleRegistry::Instance() {
  // Function-local static: constructed on first use, so registrars in other
  // translation units never see it uninitialised.
  static ModuleRegistry registry;
  return registry;
}

void ModuleRegistry::Add(ModuleInitFn fn) { fns_.push_back(std::move(fn)); }

void ModuleRegistry::InitModule(pybind11::module_ &m) const {
  for (const auto &fn : fns_) {
    fn(m);
  }
}

}  // namespace opmux

PYBIND11_MODULE(MS_EXTENSION_NAME, m) {
  m.doc() = "opmux MindSpore extension (PyboostRunner ops)";
  ::opmux::ModuleRegistry::Instance().InitModule(m);
}
