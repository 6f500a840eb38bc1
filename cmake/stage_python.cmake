# Stages an importable package for development: <build>/python/moriio_native holds symlinks to
# every source file plus the freshly built _native module. Run as `cmake -P` with SRC and DST.
file(GLOB_RECURSE _files RELATIVE ${SRC} ${SRC}/*.py ${SRC}/*.pyi ${SRC}/py.typed)
foreach(f ${_files})
  if(f MATCHES "__pycache__")
    continue()
  endif()
  get_filename_component(_dir ${DST}/${f} DIRECTORY)
  file(MAKE_DIRECTORY ${_dir})
  file(CREATE_LINK ${SRC}/${f} ${DST}/${f} SYMBOLIC)
endforeach()
