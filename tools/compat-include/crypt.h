/* <crypt.h> for zig's glibc targets, which ship no libcrypt headers (zig has them for musl only).
 *
 * CPython <= 3.8's Python.h includes <crypt.h> whenever its pyconfig.h says HAVE_CRYPT_H, only to declare crypt();
 * apex never calls it. tools/build_cell.py adds this directory with -idirafter, so it is searched only after every
 * system include directory: a toolchain that has the real header keeps using it. The declaration is glibc's
 * (libcrypt.so.1). */
#ifndef APEX_COMPAT_CRYPT_H
#define APEX_COMPAT_CRYPT_H
#ifdef __cplusplus
extern "C" {
#endif
char *crypt(const char *key, const char *salt);
#ifdef __cplusplus
}
#endif
#endif
