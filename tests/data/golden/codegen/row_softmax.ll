; ModuleID = 'kiln_cpu'
source_filename = "kiln_cpu"
target datalayout = "e-m:e-p270:32:32-p271:32:32-p272:64:64-i64:64-f80:128-n8:16:32:64-S128"
target triple = "x86_64-pc-linux-gnu"

; Function Attrs: nounwind
define void @row_softmax(ptr %buffers, i64 %begin, i64 %end) #0 {
entry:
  %0 = alloca double, align 8
  %1 = alloca i8, align 1
  %2 = alloca float, align 4
  %3 = alloca float, i64 64, align 4
  %4 = getelementptr inbounds ptr, ptr %buffers, i64 0
  %p0 = load ptr, ptr %4, align 8
  %5 = getelementptr inbounds ptr, ptr %buffers, i64 1
  %p1 = load ptr, ptr %5, align 8
  %6 = icmp slt i64 %begin, %end
  br i1 %6, label %loop, label %loop.end9

loop:                                             ; preds = %loop.end8, %entry
  %i = phi i64 [ %begin, %entry ], [ %109, %loop.end8 ]
  store float 0xFFF0000000000000, ptr %2, align 4
  store i8 0, ptr %1, align 1
  br i1 true, label %loop1, label %loop.end

loop1:                                            ; preds = %loop1, %loop
  %i2 = phi i64 [ 0, %loop ], [ %19, %loop1 ]
  %7 = add nsw i64 0, %i2
  %8 = mul nsw i64 %i, 64
  %9 = add nsw i64 0, %8
  %10 = add nsw i64 %9, %i2
  %11 = getelementptr inbounds float, ptr %p0, i64 %10
  %12 = load float, ptr %11, align 4, !alias.scope !0, !noalias !3
  %13 = load float, ptr %2, align 4
  %14 = call nnan nsz float @llvm.maxnum.f32(float %13, float %12)
  store float %14, ptr %2, align 4
  %15 = fcmp uno float %12, %12
  %16 = zext i1 %15 to i8
  %17 = load i8, ptr %1, align 1
  %18 = or i8 %17, %16
  store i8 %18, ptr %1, align 1
  %19 = add nsw i64 %i2, 1
  %20 = icmp slt i64 %19, 64
  br i1 %20, label %loop1, label %loop.end, !llvm.loop !5

loop.end:                                         ; preds = %loop1, %loop
  %21 = load float, ptr %2, align 4
  %22 = load i8, ptr %1, align 1
  %23 = icmp ne i8 %22, 0
  %24 = select i1 %23, float 0x7FF8000000000000, float %21
  store double 0.000000e+00, ptr %0, align 8
  br i1 true, label %loop3, label %loop.end5

loop3:                                            ; preds = %loop3, %loop.end
  %i4 = phi i64 [ 0, %loop.end ], [ %68, %loop3 ]
  %25 = add nsw i64 0, %i4
  %26 = mul nsw i64 %i, 64
  %27 = add nsw i64 0, %26
  %28 = add nsw i64 %27, %i4
  %29 = getelementptr inbounds float, ptr %p0, i64 %28
  %30 = load float, ptr %29, align 4, !alias.scope !0, !noalias !3
  %31 = fsub float %30, %24
  %32 = fcmp olt float %31, 0xC059FE3680000000
  %33 = select i1 %32, float 0.000000e+00, float %31
  %34 = fcmp ogt float %33, 8.900000e+01
  %35 = select i1 %34, float 8.900000e+01, float %33
  %36 = call float @llvm.fmuladd.f32(float %35, float 0x3FF7154760000000, float 0x4168000000000000)
  %37 = fsub float %36, 0x4168000000000000
  %38 = call float @llvm.fmuladd.f32(float %37, float 0xBFE6300000000000, float %35)
  %39 = call float @llvm.fmuladd.f32(float %37, float 0x3F2BD01060000000, float %38)
  %40 = call float @llvm.fmuladd.f32(float 0x3F2A0D2CE0000000, float %39, float 0x3F56E879C0000000)
  %41 = call float @llvm.fmuladd.f32(float %40, float %39, float 0x3F81112100000000)
  %42 = call float @llvm.fmuladd.f32(float %41, float %39, float 0x3FA5553820000000)
  %43 = call float @llvm.fmuladd.f32(float %42, float %39, float 0x3FC5555540000000)
  %44 = call float @llvm.fmuladd.f32(float %43, float %39, float 5.000000e-01)
  %45 = fmul float %39, %39
  %46 = fmul float %44, %45
  %47 = fadd float %46, %39
  %48 = fadd float %47, 1.000000e+00
  %49 = bitcast float %36 to i32
  %50 = sub i32 %49, 1262485504
  %51 = ashr i32 %50, 1
  %52 = sub i32 %50, %51
  %53 = add i32 %52, 127
  %54 = shl i32 %53, 23
  %55 = bitcast i32 %54 to float
  %56 = add i32 %51, 127
  %57 = shl i32 %56, 23
  %58 = bitcast i32 %57 to float
  %59 = fmul float %48, %58
  %60 = fmul float %59, %55
  %61 = select i1 %32, float 0.000000e+00, float %60
  %62 = fcmp uno float %31, %31
  %63 = select i1 %62, float %31, float %61
  %64 = fpext float %63 to double
  %65 = getelementptr inbounds float, ptr %3, i64 %25
  store float %63, ptr %65, align 4
  %66 = load double, ptr %0, align 8
  %67 = fadd reassoc double %66, %64
  store double %67, ptr %0, align 8
  %68 = add nsw i64 %i4, 1
  %69 = icmp slt i64 %68, 64
  br i1 %69, label %loop3, label %loop.end5, !llvm.loop !8

loop.end5:                                        ; preds = %loop3, %loop.end
  %70 = load double, ptr %0, align 8
  br i1 true, label %loop6, label %loop.end8

loop6:                                            ; preds = %loop6, %loop.end5
  %i7 = phi i64 [ 0, %loop.end5 ], [ %107, %loop6 ]
  %71 = add nsw i64 0, %i7
  %72 = getelementptr inbounds float, ptr %3, i64 %71
  %73 = load float, ptr %72, align 4
  %74 = mul nsw i64 %i, 64
  %75 = add nsw i64 0, %74
  %76 = add nsw i64 %75, %i7
  %77 = getelementptr inbounds float, ptr %p0, i64 %76
  %78 = load float, ptr %77, align 4, !alias.scope !0, !noalias !3
  %79 = fsub float %78, %24
  %80 = fpext float %73 to double
  %81 = fdiv double 1.000000e+00, %70
  %82 = fptrunc double %81 to float
  %83 = fpext float %82 to double
  %84 = fsub double %81, %83
  %85 = fptrunc double %84 to float
  %86 = fmul float %73, %85
  %87 = call float @llvm.fma.f32(float %73, float %82, float %86)
  %88 = bitcast float %87 to i32
  %89 = and i32 %88, 2147483647
  %90 = icmp ugt i32 %89, 2139095040
  %91 = lshr i32 %88, 16
  %92 = and i32 %91, 1
  %93 = add i32 %88, 32767
  %94 = add i32 %93, %92
  %95 = and i32 %94, -65536
  %96 = or i32 %88, 4194304
  %97 = and i32 %96, -65536
  %98 = select i1 %90, i32 %97, i32 %95
  %99 = bitcast i32 %98 to float
  %100 = bitcast float %99 to i32
  %101 = lshr i32 %100, 16
  %102 = trunc i32 %101 to i16
  %103 = mul nsw i64 %i, 64
  %104 = add nsw i64 0, %103
  %105 = add nsw i64 %104, %i7
  %106 = getelementptr inbounds i16, ptr %p1, i64 %105
  store i16 %102, ptr %106, align 2, !alias.scope !3, !noalias !0
  %107 = add nsw i64 %i7, 1
  %108 = icmp slt i64 %107, 64
  br i1 %108, label %loop6, label %loop.end8, !llvm.loop !9

loop.end8:                                        ; preds = %loop6, %loop.end5
  %109 = add nsw i64 %i, 1
  %110 = icmp slt i64 %109, %end
  br i1 %110, label %loop, label %loop.end9

loop.end9:                                        ; preds = %loop.end8, %entry
  ret void
}

; Function Attrs: nocallback nofree nosync nounwind speculatable willreturn memory(none)
declare float @llvm.maxnum.f32(float, float) #1

; Function Attrs: nocallback nofree nosync nounwind speculatable willreturn memory(none)
declare float @llvm.fmuladd.f32(float, float, float) #1

; Function Attrs: nocallback nofree nosync nounwind speculatable willreturn memory(none)
declare float @llvm.fma.f32(float, float, float) #1

attributes #0 = { nounwind "prefer-vector-width"="512" "target-cpu"="skylake-avx512" "target-features"="+avx,+avx2,+avx512bw,+avx512dq,+avx512f,+avx512vl,+f16c,+fma" }
attributes #1 = { nocallback nofree nosync nounwind speculatable willreturn memory(none) }

!0 = !{!1}
!1 = distinct !{!1, !2, !"p0"}
!2 = distinct !{!2, !"kiln.buffers"}
!3 = !{!4}
!4 = distinct !{!4, !2, !"p1"}
!5 = distinct !{!5, !6, !7}
!6 = !{!"llvm.loop.vectorize.width", i32 16}
!7 = !{!"llvm.loop.interleave.count", i32 1}
!8 = distinct !{!8, !6, !7}
!9 = distinct !{!9, !6, !7}
