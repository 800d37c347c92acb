; ModuleID = 'kiln_cpu'
source_filename = "kiln_cpu"
target datalayout = "e-m:e-p270:32:32-p271:32:32-p272:64:64-i64:64-f80:128-n8:16:32:64-S128"
target triple = "x86_64-pc-linux-gnu"

; Function Attrs: nounwind
define void @layer_norm(ptr %buffers, i64 %begin, i64 %end) #0 {
entry:
  %0 = alloca double, align 8
  %1 = alloca double, align 8
  %2 = alloca double, i64 64, align 8
  %3 = getelementptr inbounds ptr, ptr %buffers, i64 0
  %p0 = load ptr, ptr %3, align 8
  %4 = getelementptr inbounds ptr, ptr %buffers, i64 1
  %p1 = load ptr, ptr %4, align 8
  %5 = getelementptr inbounds ptr, ptr %buffers, i64 2
  %p2 = load ptr, ptr %5, align 8
  %6 = getelementptr inbounds ptr, ptr %buffers, i64 3
  %p3 = load ptr, ptr %6, align 8
  %7 = getelementptr inbounds ptr, ptr %buffers, i64 4
  %p4 = load ptr, ptr %7, align 8
  %8 = getelementptr inbounds ptr, ptr %buffers, i64 5
  %p5 = load ptr, ptr %8, align 8
  %9 = icmp slt i64 %begin, %end
  br i1 %9, label %loop, label %loop.end9

loop:                                             ; preds = %loop.end8, %entry
  %i = phi i64 [ %begin, %entry ], [ %133, %loop.end8 ]
  store double 0.000000e+00, ptr %1, align 8
  br i1 true, label %loop1, label %loop.end

loop1:                                            ; preds = %loop1, %loop
  %i2 = phi i64 [ 0, %loop ], [ %27, %loop1 ]
  %10 = add nsw i64 0, %i2
  %11 = mul nsw i64 %i, 64
  %12 = add nsw i64 0, %11
  %13 = add nsw i64 %12, %i2
  %14 = getelementptr inbounds float, ptr %p0, i64 %13
  %15 = load float, ptr %14, align 4, !alias.scope !0, !noalias !3
  %16 = add nsw i64 0, %i2
  %17 = getelementptr inbounds float, ptr %p1, i64 %16
  %18 = load float, ptr %17, align 4, !alias.scope !9, !noalias !10
  %19 = add nsw i64 0, %i2
  %20 = getelementptr inbounds float, ptr %p2, i64 %19
  %21 = load float, ptr %20, align 4, !alias.scope !11, !noalias !12
  %22 = fpext float %15 to double
  %23 = fpext float %18 to double
  %24 = fpext float %21 to double
  %25 = load double, ptr %1, align 8
  %26 = fadd reassoc double %25, %22
  store double %26, ptr %1, align 8
  %27 = add nsw i64 %i2, 1
  %28 = icmp slt i64 %27, 64
  br i1 %28, label %loop1, label %loop.end, !llvm.loop !13

loop.end:                                         ; preds = %loop1, %loop
  %29 = load double, ptr %1, align 8
  %30 = mul nsw i64 %i, 64
  %31 = add nsw i64 0, %30
  %32 = getelementptr inbounds float, ptr %p0, i64 %31
  %33 = load float, ptr %32, align 4, !alias.scope !0, !noalias !3
  %34 = getelementptr inbounds float, ptr %p1, i64 0
  %35 = load float, ptr %34, align 4, !alias.scope !9, !noalias !10
  %36 = getelementptr inbounds float, ptr %p2, i64 0
  %37 = load float, ptr %36, align 4, !alias.scope !11, !noalias !12
  %38 = fpext float %33 to double
  %39 = fdiv double %29, 6.400000e+01
  %40 = fsub double %38, %39
  %41 = fmul double %40, %40
  %42 = fpext float %35 to double
  %43 = fpext float %37 to double
  %44 = fptrunc double %39 to float
  %45 = add nsw i64 0, %i
  %46 = getelementptr inbounds float, ptr %p4, i64 %45
  store float %44, ptr %46, align 4, !alias.scope !16, !noalias !17
  store double 0.000000e+00, ptr %0, align 8
  br i1 true, label %loop3, label %loop.end5

loop3:                                            ; preds = %loop3, %loop.end
  %i4 = phi i64 [ 0, %loop.end ], [ %69, %loop3 ]
  %47 = add nsw i64 0, %i4
  %48 = mul nsw i64 %i, 64
  %49 = add nsw i64 0, %48
  %50 = add nsw i64 %49, %i4
  %51 = getelementptr inbounds float, ptr %p0, i64 %50
  %52 = load float, ptr %51, align 4, !alias.scope !0, !noalias !3
  %53 = add nsw i64 0, %i4
  %54 = getelementptr inbounds float, ptr %p1, i64 %53
  %55 = load float, ptr %54, align 4, !alias.scope !9, !noalias !10
  %56 = add nsw i64 0, %i4
  %57 = getelementptr inbounds float, ptr %p2, i64 %56
  %58 = load float, ptr %57, align 4, !alias.scope !11, !noalias !12
  %59 = fpext float %52 to double
  %60 = fdiv double %29, 6.400000e+01
  %61 = fsub double %59, %60
  %62 = fmul double %61, %61
  %63 = fpext float %55 to double
  %64 = fpext float %58 to double
  %65 = fptrunc double %60 to float
  %66 = getelementptr inbounds double, ptr %2, i64 %47
  store double %61, ptr %66, align 8
  %67 = load double, ptr %0, align 8
  %68 = fadd reassoc double %67, %62
  store double %68, ptr %0, align 8
  %69 = add nsw i64 %i4, 1
  %70 = icmp slt i64 %69, 64
  br i1 %70, label %loop3, label %loop.end5, !llvm.loop !18

loop.end5:                                        ; preds = %loop3, %loop.end
  %71 = load double, ptr %0, align 8
  %72 = mul nsw i64 %i, 64
  %73 = add nsw i64 0, %72
  %74 = getelementptr inbounds float, ptr %p0, i64 %73
  %75 = load float, ptr %74, align 4, !alias.scope !0, !noalias !3
  %76 = getelementptr inbounds float, ptr %p1, i64 0
  %77 = load float, ptr %76, align 4, !alias.scope !9, !noalias !10
  %78 = getelementptr inbounds float, ptr %p2, i64 0
  %79 = load float, ptr %78, align 4, !alias.scope !11, !noalias !12
  %80 = fpext float %75 to double
  %81 = fdiv double %29, 6.400000e+01
  %82 = fsub double %80, %81
  %83 = fmul double %82, %82
  %84 = fdiv double %71, 6.400000e+01
  %85 = fadd double %84, 1.000000e-05
  %86 = call double @llvm.sqrt.f64(double %85)
  %87 = fdiv double 1.000000e+00, %86
  %88 = fmul double %82, %87
  %89 = fpext float %77 to double
  %90 = fmul double %88, %89
  %91 = fpext float %79 to double
  %92 = fadd double %90, %91
  %93 = fptrunc double %92 to float
  %94 = fptrunc double %81 to float
  %95 = fptrunc double %87 to float
  %96 = add nsw i64 0, %i
  %97 = getelementptr inbounds float, ptr %p5, i64 %96
  store float %95, ptr %97, align 4, !alias.scope !19, !noalias !20
  br i1 true, label %loop6, label %loop.end8

loop6:                                            ; preds = %loop6, %loop.end5
  %i7 = phi i64 [ 0, %loop.end5 ], [ %131, %loop6 ]
  %98 = add nsw i64 0, %i7
  %99 = getelementptr inbounds double, ptr %2, i64 %98
  %100 = load double, ptr %99, align 8
  %101 = mul nsw i64 %i, 64
  %102 = add nsw i64 0, %101
  %103 = add nsw i64 %102, %i7
  %104 = getelementptr inbounds float, ptr %p0, i64 %103
  %105 = load float, ptr %104, align 4, !alias.scope !0, !noalias !3
  %106 = add nsw i64 0, %i7
  %107 = getelementptr inbounds float, ptr %p1, i64 %106
  %108 = load float, ptr %107, align 4, !alias.scope !9, !noalias !10
  %109 = add nsw i64 0, %i7
  %110 = getelementptr inbounds float, ptr %p2, i64 %109
  %111 = load float, ptr %110, align 4, !alias.scope !11, !noalias !12
  %112 = fpext float %105 to double
  %113 = fdiv double %29, 6.400000e+01
  %114 = fmul double %100, %100
  %115 = fdiv double %71, 6.400000e+01
  %116 = fadd double %115, 1.000000e-05
  %117 = call double @llvm.sqrt.f64(double %116)
  %118 = fdiv double 1.000000e+00, %117
  %119 = fmul double %100, %118
  %120 = fpext float %108 to double
  %121 = fmul double %119, %120
  %122 = fpext float %111 to double
  %123 = fadd double %121, %122
  %124 = fptrunc double %123 to float
  %125 = fptrunc double %113 to float
  %126 = fptrunc double %118 to float
  %127 = mul nsw i64 %i, 64
  %128 = add nsw i64 0, %127
  %129 = add nsw i64 %128, %i7
  %130 = getelementptr inbounds float, ptr %p3, i64 %129
  store float %124, ptr %130, align 4, !alias.scope !21, !noalias !22
  %131 = add nsw i64 %i7, 1
  %132 = icmp slt i64 %131, 64
  br i1 %132, label %loop6, label %loop.end8, !llvm.loop !23

loop.end8:                                        ; preds = %loop6, %loop.end5
  %133 = add nsw i64 %i, 1
  %134 = icmp slt i64 %133, %end
  br i1 %134, label %loop, label %loop.end9

loop.end9:                                        ; preds = %loop.end8, %entry
  ret void
}

; Function Attrs: nocallback nofree nosync nounwind speculatable willreturn memory(none)
declare double @llvm.sqrt.f64(double) #1

attributes #0 = { nounwind "prefer-vector-width"="512" "target-cpu"="skylake-avx512" "target-features"="+avx,+avx2,+avx512bw,+avx512dq,+avx512f,+avx512vl,+f16c,+fma" }
attributes #1 = { nocallback nofree nosync nounwind speculatable willreturn memory(none) }

!0 = !{!1}
!1 = distinct !{!1, !2, !"p0"}
!2 = distinct !{!2, !"kiln.buffers"}
!3 = !{!4, !5, !6, !7, !8}
!4 = distinct !{!4, !2, !"p1"}
!5 = distinct !{!5, !2, !"p2"}
!6 = distinct !{!6, !2, !"p3"}
!7 = distinct !{!7, !2, !"p4"}
!8 = distinct !{!8, !2, !"p5"}
!9 = !{!4}
!10 = !{!1, !5, !6, !7, !8}
!11 = !{!5}
!12 = !{!1, !4, !6, !7, !8}
!13 = distinct !{!13, !14, !15}
!14 = !{!"llvm.loop.vectorize.width", i32 16}
!15 = !{!"llvm.loop.interleave.count", i32 1}
!16 = !{!7}
!17 = !{!1, !4, !5, !6, !8}
!18 = distinct !{!18, !14, !15}
!19 = !{!8}
!20 = !{!1, !4, !5, !6, !7}
!21 = !{!6}
!22 = !{!1, !4, !5, !7, !8}
!23 = distinct !{!23, !14, !15}
