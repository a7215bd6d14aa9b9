// Local, hidden definitions of the few runtime symbols that a new toolchain's headers (gcc >= 11,
// glibc >= 2.32) make the library import, but that the C++ runtime and glibc of torch's manylinux_2_28
// wheels do not have. torch's wheels need at most GLIBCXX_3.4.22 and GLIBC_2.28; without these
// definitions a gcc 12 build imports GLIBCXX_3.4.26 (two stringstream constructors), GLIBCXX_3.4.29
// (std::__throw_bad_array_new_length) and GLIBC_2.32 (__libc_single_threaded) and cannot load on
// RHEL 8, Ubuntu 20.04 or Debian 11. This is what the manylinux toolchains do (gcc-toolset links the
// newer parts of libstdc++ statically from libstdc++_nonshared.a); everything else of the C++ runtime
// (exceptions, typeinfo, allocation) stays the one shared libstdc++ of the process, so exceptions thrown
// here and caught by torch's dispatcher keep one runtime's bookkeeping. tests/test_wheel.py reads the
// built library's symbol versions. The definitions are harmless with an older toolchain (nothing then
// refers to them) and are hidden: nothing is exported.
#include <new>
#include <sstream>

#define REDFUSER_LOCAL __attribute__((visibility("hidden"), used))

// glibc 2.32: libstdc++'s headers read it to skip atomic reference counting in a single-threaded
// process. 0 = "maybe multi-threaded": shared_ptr & co. always use atomics, which is always correct.
extern "C" {
REDFUSER_LOCAL char __libc_single_threaded = 0;
}

// GLIBCXX_3.4.29: thrown by std::allocator<T>::allocate (new_allocator.h) when n * sizeof(T) overflows.
[[noreturn]] REDFUSER_LOCAL void redfuser_throw_bad_array_new_length() __asm__("_ZSt28__throw_bad_array_new_lengthv");
[[noreturn]] REDFUSER_LOCAL void redfuser_throw_bad_array_new_length() { throw std::bad_array_new_length(); }

// GLIBCXX_3.4.26: the default constructors added in gcc 9. Each is the openmode constructor with the
// default mode (gcc 12 <sstream>: the same member initialisers), constructed in place (complete object).
REDFUSER_LOCAL void redfuser_ostringstream_ctor(void* self) __asm__("_ZNSt7__cxx1119basic_ostringstreamIcSt11char_traitsIcESaIcEEC1Ev");
REDFUSER_LOCAL void redfuser_ostringstream_ctor(void* self) { ::new (self) std::ostringstream(std::ios_base::out); }
REDFUSER_LOCAL void redfuser_stringstream_ctor(void* self) __asm__("_ZNSt7__cxx1118basic_stringstreamIcSt11char_traitsIcESaIcEEC1Ev");
REDFUSER_LOCAL void redfuser_stringstream_ctor(void* self) {
  ::new (self) std::stringstream(std::ios_base::in | std::ios_base::out);
}
