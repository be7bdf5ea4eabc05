# Writes a C file holding a file's bytes (cmake -DIN=FILE -DOUT=FILE.c -DNAME=symbol -P embed.cmake):
# `const char NAME[]` (NUL-terminated) and `const size_t NAME_len`. Used to compile the dashboard
# page into the moeserve binary without any tool beyond CMake.
file(READ "${IN}" hex HEX)
string(LENGTH "${hex}" n)
math(EXPR len "${n} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
string(REGEX REPLACE "(0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,)" "\\1\n" body "${body}")
file(WRITE "${OUT}.tmp" "/* generated from ${IN} by tools/embed.cmake */\n#include <stddef.h>\nconst char ${NAME}[] = {\n${body}0};\nconst size_t ${NAME}_len = ${len};\n")
file(RENAME "${OUT}.tmp" "${OUT}")
