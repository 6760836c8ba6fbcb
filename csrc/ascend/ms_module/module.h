// Registration of functions into the single MindSpore extension module.
//
// MindSpore's CustomOpBuilder compiles every source of an extension into one
// shared library whose Python module is defined by exactly one
// PYBIND11_MODULE(MS_EXTENSION_NAME, m) (in module.cpp). Each integration file
// adds its functions with
//
//   OPMUX_MS_EXTENSION_MODULE(m) {
//     m.def("my_op", &MyOp, ...);
//   }
//
// which records a callback in a static registry at library load time; the
// module init runs all callbacks in registration order.
#ifndef OPMUX_CSRC_MODULE_MODULE_H_
#define OPMUX_CSRC_MODULE_MODULE_H_

#include <pybind11/pybind11.h>

#include <functional>
#include <vector>

namespace opmux {

using ModuleInitFn = std::function<void(pybind11::module_ &)>;

// Holds the callbacks that populate the extension module. Static-storage
// registrars append to it before PyInit runs; nothing appends afterwards.
// Hidden like pybind11's own types: it is private to the extension library.
class __attribute__((visibility("hidden"))) ModuleRegistry {
 public:
  static ModuleRegistry &Instance();

  void Add(ModuleInitFn fn);
  void InitModule(pybind11::module_ &m) const;

  ModuleRegistry(const ModuleRegistry &) = delete;
  ModuleRegistry &operator=(const ModuleRegistry &) = delete;

 private:
  ModuleRegistry() = default;
  std::vector<ModuleInitFn> fns_;
};

// Adds `fn` to the registry when constructed (at static initialisation).
struct __attribute__((visibility("hidden"))) ModuleRegistrar {
  explicit ModuleRegistrar(ModuleInitFn fn) { ModuleRegistry::Instance().Add(std::move(fn)); }
};

}  // namespace opmux

#define OPMUX_MS_CONCAT_INNER(a, b) a##b
#define OPMUX_MS_CONCAT(a, b) OPMUX_MS_CONCAT_INNER(a, b)

// Defines a function body that receives the extension module; see the header
// comment. Usable once per line, any number of times per translation unit.
#define OPMUX_MS_EXTENSION_MODULE(m)                                                         \
  static void OPMUX_MS_CONCAT(opmux_ms_module_init_, __LINE__)(pybind11::module_ &);         \
  static const ::opmux::ModuleRegistrar OPMUX_MS_CONCAT(opmux_ms_module_registrar_, __LINE__)( \
      &OPMUX_MS_CONCAT(opmux_ms_module_init_, __LINE__));                                    \
  static void OPMUX_MS_CONCAT(opmux_ms_module_init_, __LINE__)(pybind11::module_ & m)

#endif  // OPMUX_CSRC_MODULE_MODULE_H_
