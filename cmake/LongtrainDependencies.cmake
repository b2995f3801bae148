# Every dependency comes from a Debian package; scripts/install-deps.sh installs what is missing.
find_package(PkgConfig REQUIRED)
find_package(Threads REQUIRED)
find_package(yaml-cpp REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(CLI11 REQUIRED)
find_package(ZLIB REQUIRED)
find_package(Gloo REQUIRED)
pkg_check_modules(SENTENCEPIECE REQUIRED IMPORTED_TARGET sentencepiece)
# PCRE2 (Debian: libpcre2-dev) runs tokenizer.json's pre-tokenizer regexes.
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
# ICU (Debian: libicu-dev) has the Unicode tables of tokenizer.json's normalizers (NFC ... NFKD,
# Lowercase, StripAccents).
pkg_check_modules(ICU REQUIRED IMPORTED_TARGET icu-uc)

# OpenBLAS through its cblas interface (Debian: libopenblas-dev, header cblas.h).
set(BLA_VENDOR OpenBLAS)
find_package(BLAS REQUIRED)
find_path(CBLAS_INCLUDE_DIR cblas.h PATH_SUFFIXES openblas REQUIRED)
add_library(longtrain_blas INTERFACE)
target_link_libraries(longtrain_blas INTERFACE ${BLAS_LIBRARIES})
target_include_directories(longtrain_blas INTERFACE ${CBLAS_INCLUDE_DIR})

# Debian's Gloo ships an imported target `gloo` whose include dir is /usr/include.
add_library(longtrain_gloo INTERFACE)
target_link_libraries(longtrain_gloo INTERFACE gloo)

if(LONGTRAIN_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
